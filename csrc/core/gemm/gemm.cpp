#include "core/gemm/gemm.h"

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <list>
#include <unordered_map>
#include <vector>

#include "core/common/cuda_check.h"
#include "core/common/device_info.h"
#include "core/common/key_hash.h"

namespace fused_dense::core {
namespace {

// ---- RAII wrappers: every cuBLASLt object is destroyed exactly once, also on throw. ----
// (A deleter has no caller to report a failed destroy to, so its status is dropped.)
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* p) const { cublasLtMatrixLayoutDestroy(p); }
};
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* p) const { cublasLtMatmulDescDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter>;
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat32: return CUDA_R_32F;
  }
  throw Error("fused_dense: unsupported dtype for cuBLASLt");
}

cudaDataType_t cuda_fp8_type(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

cublasLtEpilogue_t lt_epilogue(const GemmProblem& p) {
  switch (p.epilogue) {
    case Epilogue::kNone: return p.with_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kGelu: return p.with_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    case Epilogue::kGeluAux:
      return p.with_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kRelu: return p.with_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case Epilogue::kReluAux:
      return p.with_bias ? CUBLASLT_EPILOGUE_RELU_AUX_BIAS : CUBLASLT_EPILOGUE_RELU_AUX;
    case Epilogue::kDGelu: return p.with_bias_grad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kDRelu: return p.with_bias_grad ? CUBLASLT_EPILOGUE_DRELU_BGRAD : CUBLASLT_EPILOGUE_DRELU;
    case Epilogue::kBGradB: return CUBLASLT_EPILOGUE_BGRADB;
  }
  throw Error("fused_dense: unknown epilogue");
}

bool uses_aux(Epilogue e) {
  return e == Epilogue::kGeluAux || e == Epilogue::kReluAux || e == Epilogue::kDGelu ||
         e == Epilogue::kDRelu;
}
bool uses_bias_pointer(const GemmProblem& p) {
  return p.with_bias || p.with_bias_grad ||
         p.epilogue == Epilogue::kBGradB;
}

// cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise; a view with a
// storage offset can be less aligned, so the alignment is part of the cached problem.
uint32_t alignment_of(const void* ptr) {
  auto addr = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && (addr % align) != 0) align /= 2;
  return align;
}

template <typename T>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// The problem fields that decide the plan, flattened to integers so hashing and equality
// cannot see padding bytes.
struct CacheKey {
  static constexpr int kFields = 24;
  std::array<int64_t, kFields> v{};
  std::size_t workspace_bytes() const { return static_cast<std::size_t>(v[kFields - 1]); }
  uint32_t alignment(int i) const { return static_cast<uint32_t>(v[16 + i]); }
  bool operator==(const CacheKey& o) const { return v == o.v; }
};
struct CacheKeyHash {
  std::size_t operator()(const CacheKey& k) const { return IntArrayHash{}(k.v); }
};

// The 8 words of a cuBLASLt algorithm, as a hashable key.
using AlgoKey = std::array<int64_t, 8>;
AlgoKey algo_key(const cublasLtMatmulAlgo_t& algo) {
  static_assert(sizeof(algo.data) == sizeof(AlgoKey), "cublasLtMatmulAlgo_t holds 8 64-bit words");
  AlgoKey key;
  std::memcpy(key.data(), algo.data, sizeof(algo.data));
  return key;
}
struct AlgoKeyHash {
  std::size_t operator()(const AlgoKey& k) const { return IntArrayHash{}(k); }
};

// Everything about a problem that does not depend on the call's pointers: the operand layouts,
// built with the plan, and cuBLASLt's ranked algorithm list, asked for on first need only (a
// stored algorithm runs without it, after one cublasLtMatmulAlgoCheck per problem). Shared by
// threads: the layouts are immutable, the list is built once, the checks sit behind a lock.
struct PlannedGemm {
  uint64_t id = 0;  // unique in the process: the thread's descriptor cache is keyed by it
  Layout a, b, d;
  std::once_flag listed;
  std::vector<cublasLtMatmulHeuristicResult_t> algorithms;
  std::mutex checks_mutex;
  std::unordered_map<AlgoKey, std::size_t, AlgoKeyHash> checked;  // workspace bytes, or kRejected
};
constexpr std::size_t kRejected = ~std::size_t{0};

std::atomic<int64_t> heuristic_queries{0};
std::atomic<uint64_t> next_plan_id{1};

// Plans held at once (each a few layouts and a ranked algorithm list, ~2 KB): the least recently
// used goes first, so a process meeting ever new token counts stays within this many. 2048 holds
// the distinct problems of a model's step (a handful per layer width, times the epilogue
// variants) at several hundred token counts.
constexpr std::size_t kMaxPlans = 2048;

constexpr int kRequestedAlgorithms = 16;

MatmulDesc make_matmul_desc(const GemmProblem& p) {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (p.dtype == DType::kFloat32 && p.allow_tf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  cublasLtMatmulDesc_t raw = nullptr;
  FD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, compute, CUDA_R_32F));
  MatmulDesc desc(raw);
  cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(raw, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_attr(raw, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  set_attr(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(p));
  if (uses_aux(p.epilogue)) set_attr(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.ld_aux);
  if (p.fp8) {
    set_attr(raw, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(p.fast_accum ? 1 : 0));
    // Beside FP8 operands cuBLASLt's default bias type is not always D's (measured: an fp32 bias
    // read as bf16 with fp32 D), so it is stated; a combination it refuses is then NOT_SUPPORTED.
    if (p.with_bias) set_attr(raw, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.dtype));
  }
  return desc;
}

Layout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  FD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  return Layout(raw);
}

std::shared_ptr<PlannedGemm> plan(const GemmProblem& p) {
  auto planned = std::make_shared<PlannedGemm>();
  planned->id = next_plan_id.fetch_add(1, std::memory_order_relaxed);
  const cudaDataType_t ta = p.fp8 ? cuda_fp8_type(p.a_format) : cuda_type(p.dtype);
  const cudaDataType_t tb = p.fp8 ? cuda_fp8_type(p.b_format) : cuda_type(p.dtype);
  planned->a = p.trans_a ? make_layout(ta, p.k, p.m, p.lda) : make_layout(ta, p.m, p.k, p.lda);
  planned->b = p.trans_b ? make_layout(tb, p.n, p.k, p.ldb) : make_layout(tb, p.k, p.n, p.ldb);
  planned->d = make_layout(cuda_type(p.dtype), p.m, p.n, p.ldd);
  return planned;
}

// cuBLASLt's heuristic for the problem: its ranked list of up to kRequestedAlgorithms.
void list_algorithms(const GemmProblem& p, const CacheKey& key, PlannedGemm* planned) {
  heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  MatmulDesc desc = make_matmul_desc(p);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  FD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  Preference pref(raw_pref);
  uint64_t ws = key.workspace_bytes();
  FD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // Split-K partial sums stay in fp32. The INPLACE and OUTPUT_TYPE schemes add them up in the
  // 16-bit output type, and where the partials cancel (x.w ~= -b, small sums of large terms)
  // that rounding dominates: measured 0.2 relative error for bf16 at one row, K = 2391.
  uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  FD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      raw_pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction)));
  const cublasLtMatmulPreferenceAttributes_t align_attrs[3] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 3; ++i) {
    uint32_t a = key.alignment(i);
    FD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(raw_pref, align_attrs[i], &a, sizeof(a)));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> algorithms(kRequestedAlgorithms);
  int returned = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      device_info(p.device).cublaslt(), desc.get(), planned->a.get(), planned->b.get(), planned->d.get(),
      planned->d.get(), pref.get(), kRequestedAlgorithms, algorithms.data(), &returned);
  // NOT_SUPPORTED here means "no algorithm for this epilogue/shape": an empty list, not an error.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED)
    FD_CUBLAS_CHECK(status);
  if (status != CUBLAS_STATUS_SUCCESS) returned = 0;
  algorithms.resize(returned);
  planned->algorithms = std::move(algorithms);
}

const std::vector<cublasLtMatmulHeuristicResult_t>& algorithms_of(PlannedGemm& planned, const GemmProblem& p,
                                                                 const CacheKey& key) {
  std::call_once(planned.listed, [&] { list_algorithms(p, key, &planned); });
  return planned.algorithms;
}

// The plans by problem, bounded (kMaxPlans, least recently used dropped). A caller holds the
// shared_ptr while it uses the plan, so dropping one from the cache never frees it under a call.
class PlanCache {
 public:
  std::shared_ptr<PlannedGemm> get(const GemmProblem& problem, const CacheKey& key) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = plans_.find(key);
      if (it != plans_.end()) {
        order_.splice(order_.begin(), order_, it->second);  // most recently used first
        return it->second->second;
      }
    }
    // Plan outside the lock; a racing thread's duplicate is dropped.
    auto planned = plan(problem);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second->second;
    order_.emplace_front(key, std::move(planned));
    plans_.emplace(key, order_.begin());
    while (order_.size() > kMaxPlans) {
      plans_.erase(order_.back().first);
      order_.pop_back();
    }
    return order_.front().second;
  }

  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return order_.size();
  }

 private:
  using Order = std::list<std::pair<CacheKey, std::shared_ptr<PlannedGemm>>>;
  std::mutex mutex_;
  Order order_;
  std::unordered_map<CacheKey, Order::iterator, CacheKeyHash> plans_;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();  // never destroyed: used until process exit
  return *cache;
}

CacheKey make_key(const GemmProblem& p, const GemmPointers* ptrs, std::size_t workspace_bytes) {
  CacheKey key;
  const bool tf32 = p.dtype == DType::kFloat32 && p.allow_tf32;
  key.v = {p.device, static_cast<int64_t>(p.dtype), p.trans_a, p.trans_b, p.m, p.n, p.k, p.lda, p.ldb,
           p.ldd, static_cast<int64_t>(p.epilogue), p.with_bias, p.with_bias_grad,
           uses_aux(p.epilogue) ? p.ld_aux : 0, p.accumulate, tf32,
           ptrs ? alignment_of(ptrs->a) : 256, ptrs ? alignment_of(ptrs->b) : 256,
           ptrs ? alignment_of(ptrs->d) : 256, p.fp8, p.fp8 ? static_cast<int64_t>(p.a_format) : 0,
           p.fp8 ? static_cast<int64_t>(p.b_format) : 0, p.fp8 && p.fast_accum,
           static_cast<int64_t>(workspace_bytes)};
  return key;
}

std::string describe(const GemmProblem& p) {
  std::ostringstream s;
  s << "m=" << p.m << " n=" << p.n << " k=" << p.k << " dtype=" << dtype_name(p.dtype)
    << " epilogue=" << static_cast<int>(p.epilogue) << (p.with_bias ? " +bias" : "")
    << (p.with_bias_grad ? " +bias_grad" : "");
  if (p.fp8) s << " fp8 a=" << fp8_format_name(p.a_format) << " b=" << fp8_format_name(p.b_format);
  return s.str();
}

// The matmul descriptor of a plan, built once per thread: everything in it but the operand
// pointers is fixed by the plan, and the pointers are set on each call, which is why it is not
// shared between threads. Keyed by the plan's id (never reused); emptied when it would pass
// kMaxPlans, as the plans themselves are bounded.
cublasLtMatmulDesc_t thread_matmul_desc(PlannedGemm& planned, const GemmProblem& p) {
  thread_local std::unordered_map<uint64_t, MatmulDesc> descs;
  auto it = descs.find(planned.id);
  if (it == descs.end()) {
    if (descs.size() >= kMaxPlans) descs.clear();
    it = descs.emplace(planned.id, make_matmul_desc(p)).first;
  }
  return it->second.get();
}

enum class Outcome { kDone, kRefused };

// The thread's descriptor of the plan with the call's epilogue pointers set.
cublasLtMatmulDesc_t bound_desc(PlannedGemm& planned, const GemmProblem& p, const GemmPointers& ptrs) {
  cublasLtMatmulDesc_t desc = thread_matmul_desc(planned, p);
  if (uses_bias_pointer(p)) {
    const void* bias = (p.with_bias_grad || p.epilogue == Epilogue::kBGradB) ? ptrs.bias_grad : ptrs.bias;
    set_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  }
  if (uses_aux(p.epilogue)) set_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptrs.aux);
  if (p.fp8) {
    set_attr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ptrs.a_scale);
    set_attr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ptrs.b_scale);
  }
  return desc;
}

// Launches `algo` with the call's pointers.
Outcome launch(PlannedGemm& planned, const GemmProblem& p, const GemmPointers& ptrs, const cublasLtMatmulAlgo_t& algo,
               const Workspace& ws, cudaStream_t stream) {
  cublasLtMatmulDesc_t desc = bound_desc(planned, p, ptrs);
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  cublasStatus_t status =
      cublasLtMatmul(device_info(p.device).cublaslt(), desc, &alpha, ptrs.a, planned.a.get(), ptrs.b, planned.b.get(),
                     &beta, ptrs.d, planned.d.get(), ptrs.d, planned.d.get(), &algo, ws.ptr, ws.bytes, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return Outcome::kRefused;
  FD_CUBLAS_CHECK(status);
  return Outcome::kDone;
}

Outcome run(const GemmProblem& p, const GemmPointers& ptrs, int heuristic, const Workspace& ws,
            cudaStream_t stream) {
  if (heuristic < 0) throw Error("fused_dense: internal error: negative heuristic reached gemm()");
  const CacheKey key = make_key(p, &ptrs, ws.bytes);
  const std::shared_ptr<PlannedGemm> held = plan_cache().get(p, key);
  PlannedGemm& planned = *held;
  const auto& algorithms = algorithms_of(planned, p, key);
  const int count = static_cast<int>(algorithms.size());
  if (count == 0) return Outcome::kRefused;
  if (heuristic >= count) {
    std::ostringstream msg;
    msg << "fused_dense: heuristic=" << heuristic << " is out of range: cuBLASLt offers " << count
        << " algorithm(s) for this problem (" << describe(p) << "), so heuristic must be in [0, "
        << count - 1 << "] (or -1 for the unfused path)";
    throw HeuristicOutOfRange(msg.str());
  }
  return launch(planned, p, ptrs, algorithms[heuristic].algo, ws, stream);
}

// Whether `algo` serves this exact problem with the workspace given: cublasLtMatmulAlgoCheck,
// asked once per problem and algorithm.
bool algorithm_fits(PlannedGemm& planned, const GemmProblem& p, const GemmPointers& ptrs,
                    const cublasLtMatmulAlgo_t& algo, std::size_t workspace_bytes) {
  const AlgoKey akey = algo_key(algo);
  {
    std::lock_guard<std::mutex> lock(planned.checks_mutex);
    auto it = planned.checked.find(akey);
    if (it != planned.checked.end()) return it->second != kRejected && it->second <= workspace_bytes;
  }
  cublasLtMatmulHeuristicResult_t result{};
  const cublasStatus_t status =
      cublasLtMatmulAlgoCheck(device_info(p.device).cublaslt(), bound_desc(planned, p, ptrs), planned.a.get(),
                              planned.b.get(), planned.d.get(), planned.d.get(), &algo, &result);
  // Any refusal (NOT_SUPPORTED, INVALID_VALUE for an algorithm of another shape class or of another
  // cuBLASLt build) means: not this algorithm here; the caller takes the rule's choice.
  const std::size_t need =
      (status == CUBLAS_STATUS_SUCCESS && result.state == CUBLAS_STATUS_SUCCESS) ? result.workspaceSize : kRejected;
  std::lock_guard<std::mutex> lock(planned.checks_mutex);
  planned.checked.emplace(akey, need);
  return need != kRejected && need <= workspace_bytes;
}

}  // namespace

std::size_t gemm_workspace_bytes(int device) {
  return device_info(device).cc_major() >= 9 ? (32u << 20) : (4u << 20);
}

int gemm_algorithm_count(const GemmProblem& problem) {
  const CacheKey key = make_key(problem, nullptr, gemm_workspace_bytes(problem.device));
  const std::shared_ptr<PlannedGemm> held = plan_cache().get(problem, key);
  return static_cast<int>(algorithms_of(*held, problem, key).size());
}

bool gemm_algorithm(const GemmProblem& problem, int index, cublasLtMatmulAlgo_t* algo) {
  const CacheKey key = make_key(problem, nullptr, gemm_workspace_bytes(problem.device));
  const std::shared_ptr<PlannedGemm> held = plan_cache().get(problem, key);
  const auto& algorithms = algorithms_of(*held, problem, key);
  if (index < 0 || index >= static_cast<int>(algorithms.size())) return false;
  *algo = algorithms[index].algo;
  return true;
}

bool try_gemm_algorithm(const GemmProblem& problem, const GemmPointers& ptrs, const cublasLtMatmulAlgo_t& algo,
                        const Workspace& workspace, cudaStream_t stream) {
  const std::shared_ptr<PlannedGemm> held = plan_cache().get(problem, make_key(problem, &ptrs, workspace.bytes));
  PlannedGemm& planned = *held;
  if (!algorithm_fits(planned, problem, ptrs, algo, workspace.bytes)) return false;
  return launch(planned, problem, ptrs, algo, workspace, stream) == Outcome::kDone;
}

int64_t gemm_heuristic_queries() { return heuristic_queries.load(std::memory_order_relaxed); }

int64_t gemm_plans_cached() { return static_cast<int64_t>(plan_cache().size()); }

bool try_gemm(const GemmProblem& problem, const GemmPointers& ptrs, int heuristic,
              const Workspace& workspace, cudaStream_t stream) {
  return run(problem, ptrs, heuristic, workspace, stream) == Outcome::kDone;
}

void gemm(const GemmProblem& problem, const GemmPointers& ptrs, int heuristic,
          const Workspace& workspace, cudaStream_t stream) {
  if (run(problem, ptrs, heuristic, workspace, stream) == Outcome::kRefused) {
    throw Error("fused_dense: cuBLASLt offers no algorithm for " + describe(problem));
  }
}

}  // namespace fused_dense::core
