#include "core/common/cuda_context.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "core/common/cuda_check.h"

namespace fused_dense::core {
namespace {

using CtxGetCurrent = CUresult (*)(CUcontext*);
using PrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using CtxSetCurrent = CUresult (*)(CUcontext);

// The driver's function `name` through the runtime (the library does not link libcuda itself).
template <class F>
F driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  FD_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw Error(std::string("fused_dense: the CUDA driver offers no ") + name);
  return reinterpret_cast<F>(fn);
}

struct Driver {
  CtxGetCurrent get_current = driver_entry<CtxGetCurrent>("cuCtxGetCurrent");
  PrimaryCtxRetain retain_primary = driver_entry<PrimaryCtxRetain>("cuDevicePrimaryCtxRetain");
  CtxSetCurrent set_current = driver_entry<CtxSetCurrent>("cuCtxSetCurrent");
};

const Driver& driver() {
  static const Driver d;  // thread-safe initialisation; never changes after
  return d;
}

void check(CUresult status, const char* call) {
  if (status != CUDA_SUCCESS)
    throw Error(std::string("fused_dense: ") + call + " failed with CUresult " + std::to_string(status));
}

}  // namespace

void ensure_current_context(int device) {
  const Driver& d = driver();
  CUcontext current = nullptr;
  check(d.get_current(&current), "cuCtxGetCurrent");
  if (current != nullptr) return;
  // The runtime uses the device's primary context; retaining it here adds one reference, held
  // until the process exits (once per thread: afterwards the thread has a current context).
  CUcontext primary = nullptr;
  check(d.retain_primary(&primary, static_cast<CUdevice>(device)), "cuDevicePrimaryCtxRetain");
  check(d.set_current(primary), "cuCtxSetCurrent");
}

}  // namespace fused_dense::core
