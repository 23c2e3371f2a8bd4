#include "act_dgrad_sm90_impl.cuh"
// 256 x 128 tiles, 2 x 1 cluster, cooperative
FUSED_DENSE_PROBE_CONFIG(4, Epi::kGeluGradBias, cute::Shape<cute::_256, cute::_128, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
