#include "core/common/device_info.h"

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "core/common/cuda_check.h"
#include "core/common/types.h"

namespace fused_dense::core {
namespace {

// cublasLtCreate allocates the handle's resources on the current device: make that `device` for
// the call, then give the thread its current device back (also when the creation fails).
cublasLtHandle_t create_handle_on(int device) {
  int previous = 0;
  FD_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) FD_CUDA_CHECK(cudaSetDevice(device));
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t created = cublasLtCreate(&handle);
  const cudaError_t restored = previous != device ? cudaSetDevice(previous) : cudaSuccess;
  if (created != CUBLAS_STATUS_SUCCESS) {
    FD_CUBLAS_CHECK(created);
  }
  if (restored != cudaSuccess) {
    cublasLtDestroy(handle);  // the restore's error is the one to report
    FD_CUDA_CHECK(restored);
  }
  return handle;
}

struct DeviceInfoCache {
  std::mutex build_mutex;
  std::array<std::atomic<const DeviceInfo*>, kMaxDevices> infos{};
};

}  // namespace

void DeviceInfo::HandleDeleter::operator()(cublasLtHandle_t handle) const {
  // Reached only when a DeviceInfo is discarded (the cache keeps its own until the process
  // exits, as destroying them at exit would race the CUDA context's teardown); a destructor has
  // no caller to report a failed status to.
  cublasLtDestroy(handle);
}

DeviceInfo::DeviceInfo(int device) : device_(device) {
  cudaDeviceProp prop{};
  FD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  cc_major_ = prop.major;
  cc_minor_ = prop.minor;
  sm_count_ = prop.multiProcessorCount;
  name_ = prop.name;
  if (sm_count_ <= 0)
    throw Error("fused_dense: device " + std::to_string(device) + " reports " + std::to_string(sm_count_) +
                " multiprocessors");
  cublaslt_.reset(create_handle_on(device));
}

const DeviceInfo& device_info(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw Error("fused_dense: device index " + std::to_string(device) + " is outside [0, " +
                std::to_string(kMaxDevices) + ")");
  // Never destroyed, nor are the DeviceInfos in it: they are used until the process exits.
  static DeviceInfoCache* cache = new DeviceInfoCache();
  // Once built, the per-call cost is this one acquire load.
  if (const DeviceInfo* info = cache->infos[device].load(std::memory_order_acquire)) return *info;
  std::lock_guard<std::mutex> lock(cache->build_mutex);
  if (const DeviceInfo* info = cache->infos[device].load(std::memory_order_acquire)) return *info;
  // A build that throws stores nothing, so the next call tries again.
  const DeviceInfo* info = new DeviceInfo(device);
  cache->infos[device].store(info, std::memory_order_release);
  return *info;
}

}  // namespace fused_dense::core
