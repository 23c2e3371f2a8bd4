#include "act_dgrad_sm90_impl.cuh"
// config 1 without the bias reduction: GELU backward only
FUSED_DENSE_PROBE_CONFIG(5, Epi::kGeluGrad, cute::Shape<cute::_128, cute::_256, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
