#include "act_dgrad_sm90_impl.cuh"
// config 0 without the bias reduction: GELU backward only
FUSED_DENSE_PROBE_CONFIG(6, Epi::kGeluGrad, cute::Shape<cute::_128, cute::_128, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::epilogue::TmaWarpSpecialized)
