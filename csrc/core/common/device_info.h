// What the core needs to know about a GPU, asked once per device and kept for the process:
// its compute capability and multiprocessor count, its name (the tuning cache's tag), and the
// cuBLASLt handle the GEMMs on that device run with.
//
// Every caller names the device its call runs on (the device of the call's tensors and stream,
// e.g. LinearContext::device); nothing here reads the thread's current device.
#pragma once

#include <cublasLt.h>

#include <memory>
#include <string>
#include <type_traits>

namespace fused_dense::core {

// Device indices the cache has room for.
inline constexpr int kMaxDevices = 64;

class DeviceInfo {
 public:
  // Queries the device and creates its cuBLASLt handle; throws Error on any failed status.
  explicit DeviceInfo(int device);

  int device() const { return device_; }
  int cc_major() const { return cc_major_; }
  int cc_minor() const { return cc_minor_; }
  int sm_count() const { return sm_count_; }
  const std::string& name() const { return name_; }
  // The handle every GEMM on this device runs with, from every thread.
  cublasLtHandle_t cublaslt() const { return cublaslt_.get(); }

 private:
  struct HandleDeleter {
    void operator()(cublasLtHandle_t handle) const;
  };

  int device_ = 0;
  int cc_major_ = 0, cc_minor_ = 0;
  int sm_count_ = 0;
  std::string name_;
  std::unique_ptr<std::remove_pointer_t<cublasLtHandle_t>, HandleDeleter> cublaslt_;
};

// The cached DeviceInfo of `device`, built on the first call for that device (under a lock:
// concurrent first callers wait for one build; a failed build throws and the next call retries).
// Throws Error for a device index outside [0, kMaxDevices) or one the CUDA runtime does not know.
const DeviceInfo& device_info(int device);

}  // namespace fused_dense::core
