#include "act_dgrad_sm90_impl.cuh"
// config 1's GEMM with a plain epilogue: CUTLASS's floor for this layout
FUSED_DENSE_PROBE_CONFIG(3, Epi::kPlain, cute::Shape<cute::_128, cute::_256, cute::_64>,
                         cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
