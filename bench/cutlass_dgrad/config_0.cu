#include "act_dgrad_sm90_impl.cuh"
// 128 x 128 tiles, 2 x 1 cluster, ping-pong: one warp group's epilogue runs under the other's MMAs
FUSED_DENSE_PROBE_CONFIG(0, Epi::kGeluGradBias, cute::Shape<cute::_128, cute::_128, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::epilogue::TmaWarpSpecialized)
