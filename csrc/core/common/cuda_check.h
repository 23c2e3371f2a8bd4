// Status checking for CUDA runtime and cuBLASLt calls: every status becomes a core::Error
// naming the call, the status name and the source location.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <sstream>

#include "core/common/types.h"

namespace fused_dense::core {

const char* cublas_status_name(cublasStatus_t status);

[[noreturn]] inline void throw_status(const char* call, const char* status, const char* file, int line) {
  std::ostringstream msg;
  msg << "fused_dense: " << call << " failed with " << status << " (" << file << ":" << line << ")";
  throw Error(msg.str());
}

}  // namespace fused_dense::core

#define FD_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    cudaError_t fd_status_ = (expr);                                                           \
    if (fd_status_ != cudaSuccess)                                                             \
      ::fused_dense::core::throw_status(#expr, cudaGetErrorName(fd_status_), __FILE__, __LINE__); \
  } while (0)

#define FD_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                          \
    cublasStatus_t fd_status_ = (expr);                                                         \
    if (fd_status_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::fused_dense::core::throw_status(#expr, ::fused_dense::core::cublas_status_name(fd_status_), \
                                        __FILE__, __LINE__);                                    \
  } while (0)

// Kernel launches report configuration errors only through cudaGetLastError.
#define FD_CHECK_LAUNCH() FD_CUDA_CHECK(cudaGetLastError())
