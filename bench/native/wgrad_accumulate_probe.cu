// The LM head's weight-gradient accumulation (csrc/torch/lm_head.cpp, accumulate_grads): per chunk
// of c tokens, dW [V, d] += G^T X with G [c, V] (the chunk's logits' gradient) and X [c, d], both
// row-major, bf16, fp32 accumulation, dW read and written in bf16. Times every algorithm
// cuBLASLt's heuristic offers for it (the chunk loop runs ATen's addmm_, which takes cuBLASLt's
// first) and a few CUTLASS sm90 configurations (ping-pong, whose epilogue of one tile runs under
// the other warp group's MMAs, and cooperative), in interleaved rounds, at the chunk sizes of
// docs/performance.md's sweep, and checks each against cuBLASLt's first.
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -I$CUTLASS_PATH/include -I$CUTLASS_PATH/tools/util/include \
//     bench/native/wgrad_accumulate_probe.cu -lcublasLt -o build/wgrad_probe
//   build/wgrad_probe [rounds]
// A diagnostic (no record): prints one line per candidate and chunk size, ms (median of rounds).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#define CK(expr)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
#define CKLT(expr)                                                                                \
  do {                                                                                            \
    cublasStatus_t s_ = (expr);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                            \
      std::fprintf(stderr, "%s:%d: %s: status %d\n", __FILE__, __LINE__, #expr, int(s_));         \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

using Element = cutlass::bfloat16_t;

// In CUTLASS's terms D[M = V, N = d] row-major (dW) = A[M, K = c] * B[K, N] + C (C = D): A is G^T,
// M-major (ColumnMajor, leading dimension V); B is X, N-major (RowMajor, leading dimension d).
template <int TM, int TN, int CM, int CN, bool Coop>
struct Kernel {
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using KS = cute::conditional_t<Coop, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                 cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using ES = cute::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                 cutlass::epilogue::TmaWarpSpecialized>;
  using EpiTile = cute::Shape<cute::Int<(Coop && TM >= 128) ? 128 : 64>, cute::_32>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTile, float, float, Element,
      cutlass::layout::RowMajor, 8, Element, cutlass::layout::RowMajor, 8, ES>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KS>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  // raster 0 heuristic, 1 along M, 2 along N
  static bool run(int V, int d, int c, const void* g, const void* x, void* dw, int raster, int swizzle, void* ws,
                  size_t ws_bytes, int sm_count) {
    using GK = typename Gemm::GemmKernel;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {V, d, c, 1},
        {static_cast<const Element*>(g), cutlass::make_cute_packed_stride(typename GK::StrideA{}, cute::make_shape(V, c, 1)),
         static_cast<const Element*>(x), cutlass::make_cute_packed_stride(typename GK::StrideB{}, cute::make_shape(d, c, 1))},
        {{}, static_cast<const Element*>(dw), cutlass::make_cute_packed_stride(typename GK::StrideC{}, cute::make_shape(V, d, 1)),
         static_cast<Element*>(dw), cutlass::make_cute_packed_stride(typename GK::StrideD{}, cute::make_shape(V, d, 1))}};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 1.f;
    int dev = 0;
    CK(cudaGetDevice(&dev));
    args.hw_info.device_id = dev;
    args.hw_info.sm_count = sm_count;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.scheduler.max_swizzle_size = swizzle;
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
    if (Gemm::get_workspace_size(args) > ws_bytes) return false;
    static bool raised = false;
    constexpr int smem = static_cast<int>(GK::SharedStorageSize);
    if (!raised && smem >= (48 << 10)) {
      CK(cudaFuncSetAttribute(cutlass::device_kernel<GK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      raised = true;
    }
    if (GK::initialize_workspace(args, ws, 0, nullptr) != cutlass::Status::kSuccess) return false;
    auto params = GK::to_underlying_arguments(args, ws);
    return Gemm::run(params, 0) == cutlass::Status::kSuccess && cudaPeekAtLastError() == cudaSuccess;
  }
};

struct Candidate {
  std::string name;
  std::function<bool()> run;
};

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned(i) ^ seed) * 2654435761u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16(scale * ((h & 0xffff) / 32768.f - 1.f));
  }
}

__global__ void rel_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, double* out) {
  double num = 0, den = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  atomicAdd(out, num);
  atomicAdd(out + 1, den);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const int V = 128256, d = 4096;
  const int chunks[] = {928, 1024, 2048, 4096};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, cuBLASLt %zu, V %d d %d\n", prop.name, cublasLtGetVersion(), V, d);
  const size_t max_c = 4096;
  __nv_bfloat16 *g, *x, *dw, *ref;
  CK(cudaMalloc(&g, max_c * V * 2));
  CK(cudaMalloc(&x, max_c * d * 2));
  CK(cudaMalloc(&dw, size_t(V) * d * 2));
  CK(cudaMalloc(&ref, size_t(V) * d * 2));
  double* diff;
  CK(cudaMalloc(&diff, 16));
  const size_t ws_bytes = 64u << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  fill<<<1024, 256>>>(g, max_c * V, 1u, 1e-3f);
  fill<<<1024, 256>>>(x, max_c * d, 2u, 1.f);
  CK(cudaDeviceSynchronize());
  cublasLtHandle_t h;
  CKLT(cublasLtCreate(&h));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  for (int c : chunks) {
    // cuBLASLt, column-major: dW^T [d, V] (ld d) = X^T [d, c] (X row-major: op N, ld d) * G [c, V]
    // (G row-major [c, V] = column-major [V, c], op T, ld V), beta = 1.
    cublasLtMatmulDesc_t desc;
    CKLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tn = CUBLAS_OP_N, tt = CUBLAS_OP_T;
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tn, sizeof tn));
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tt, sizeof tt));
    cublasLtMatrixLayout_t la, lb, ld;
    CKLT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, d, c, d));
    CKLT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, V, c, V));
    CKLT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, d, V, d));
    cublasLtMatmulPreference_t pref;
    CKLT(cublasLtMatmulPreferenceCreate(&pref));
    CKLT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    CKLT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 16, res, &found));
    std::vector<Candidate> cands;
    const float one = 1.f;
    for (int i = 0; i < found; ++i) {
      cands.push_back({"cublasLt_" + std::to_string(i), [=, &h]() {
                         return cublasLtMatmul(h, desc, &one, x, la, g, lb, &one, dw, ld, dw, ld, &res[i].algo, ws,
                                               ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
                       }});
    }
    const int sms = prop.multiProcessorCount;
    auto add = [&](const char* name, auto kernel_tag, int raster, int swz) {
      using K = decltype(kernel_tag);
      cands.push_back({std::string(name) + "/r" + std::to_string(raster) + "s" + std::to_string(swz), [=]() {
                         return K::run(V, d, c, g, x, dw, raster, swz, ws, ws_bytes, sms);
                       }});
    };
    for (int r = 1; r <= 2; ++r) {
      for (int s : {1, 4}) {
        add("pp_128x128_c1x1", Kernel<128, 128, 1, 1, false>{}, r, s);
        add("pp_128x128_c2x1", Kernel<128, 128, 2, 1, false>{}, r, s);
        add("pp_128x256_c1x1", Kernel<128, 256, 1, 1, false>{}, r, s);
        add("co_256x128_c2x1", Kernel<256, 128, 2, 1, true>{}, r, s);
        add("co_128x256_c2x1", Kernel<128, 256, 2, 1, true>{}, r, s);
      }
    }
    // correctness: each candidate's dW from the same start against cuBLASLt's first
    const size_t n = size_t(V) * d;
    fill<<<1024, 256>>>(ref, n, 3u, 1e-2f);
    CK(cudaDeviceSynchronize());
    std::vector<int> ok(cands.size(), 0);
    std::vector<double> err(cands.size(), -1);
    for (size_t i = 0; i < cands.size(); ++i) {
      fill<<<1024, 256>>>(dw, n, 3u, 1e-2f);  // comparable to G^T X: a dropped C or a wrong layout shows
      if (!cands[i].run()) continue;
      CK(cudaDeviceSynchronize());
      if (i == 0) CK(cudaMemcpy(ref, dw, n * 2, cudaMemcpyDeviceToDevice));
      CK(cudaMemset(diff, 0, 16));
      rel_diff<<<1024, 256>>>(dw, ref, n, diff);
      double hd[2];
      CK(cudaMemcpy(hd, diff, 16, cudaMemcpyDeviceToHost));
      err[i] = std::sqrt(hd[0] / hd[1]);
      ok[i] = err[i] < 1e-2;
    }
    // timing: interleaved rounds of 5 launches each (dW keeps accumulating: its values only grow
    // by the small G^T X each time, as in the chunk loop)
    std::vector<std::vector<float>> t(cands.size());
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < cands.size(); ++i) {
        if (!ok[i]) continue;
        cands[i].run();  // warm
        CK(cudaEventRecord(e0));
        for (int k = 0; k < 5; ++k) cands[i].run();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t[i].push_back(ms / 5);
      }
    }
    const double tflop = 2.0 * V * d * c / 1e12;
    std::vector<std::pair<float, size_t>> order;
    for (size_t i = 0; i < cands.size(); ++i) {
      if (!ok[i]) {
        std::printf("c %5d %-28s %s (err %.2e)\n", c, cands[i].name.c_str(), err[i] < 0 ? "refused" : "WRONG", err[i]);
        continue;
      }
      std::sort(t[i].begin(), t[i].end());
      order.push_back({t[i][t[i].size() / 2], i});
    }
    std::sort(order.begin(), order.end());
    const float first = ok[0] ? t[0][t[0].size() / 2] : 0.f;
    for (auto& [ms, i] : order)
      std::printf("c %5d %-28s %.4f ms  %.0f TFLOP/s  %.3fx cuBLASLt's first  (err %.1e)\n", c, cands[i].name.c_str(),
                  ms, tflop / ms * 1e3, first > 0 ? ms / first : 0.0, err[i]);
    std::fflush(stdout);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
  cublasLtDestroy(h);
  return 0;
}
