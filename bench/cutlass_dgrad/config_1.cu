#include "act_dgrad_sm90_impl.cuh"
// 128 x 256 tiles, 2 x 1 cluster, cooperative: both warp groups on one tile
FUSED_DENSE_PROBE_CONFIG(1, Epi::kGeluGradBias, cute::Shape<cute::_128, cute::_256, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
