// The driver-API context of the calling thread. CUTLASS builds its TMA descriptors with the driver
// API (cuTensorMapEncodeTiled), which refuses with CUDA_ERROR_INVALID_CONTEXT on a thread that has
// no current context, and the runtime API runs kernels without binding one to the thread. So a
// thread whose first CUTLASS launch is not preceded by a runtime call that binds it fails:
// measured on the H200, a process whose first cutlass_sm90 kernel was a choice read from a table
// (nothing measured before it) had every TMA descriptor refused, then an illegal instruction.
#pragma once

namespace fused_dense::core {

// Makes `device`'s primary context current on the calling thread where the thread has none
// (a current context, of whatever device, is left as it is). A driver call per use; the driver's
// entry points are looked up once.
void ensure_current_context(int device);

}  // namespace fused_dense::core
