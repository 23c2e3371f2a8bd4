// The mainloop search of the library's GEMM roles (bench/native/README.md): every configuration
// build_mainloop.sh compiled, with each tile-scheduler order, timed against cuBLASLt's GEMM at the
// same shape and output, all in one run.
//   mainloop_search [--out FILE.json] [--rounds R] [--sustain-s S] [--energy-s E] [--quick | --problems I,J,...]
//   mainloop_search --profile P NAME[/ORDER] ...   (for ncu: shape P of the list, cuBLASLt's first
//                   algorithm and each named configuration (ORDER: heuristic, M or N / swizzle;
//                   default heuristic/1) launched 3 times each, checked, nothing timed or written)
// Per role and shape: a screening pass (every configuration x order and every algorithm cuBLASLt's
// heuristic offers, each the median of 5 launches), a shortlist (our best 12 of the screening)
// re-timed in 3 interleaved rounds of 5 launches (one screening pass ranked candidates up to 10%
// away from their final times), then the best 3 of the shortlist, cuBLASLt's first algorithm and
// its fastest, in R interleaved rounds (default 7) of 10 launches: once after the
// GPU idled (full clock) and once after S seconds (default 20) of back-to-back GEMMs (sustained,
// the power cap's clock). Each launch is timed alone by CUDA events after a 512 MiB L2 flush
// (whose ~0.2 ms on the GPU also hides the host's time to launch).
// Then, still hot, each finalist back to back without flushes for E seconds (--energy-s, default
// 0.5; 0 leaves it out) with NVML's energy counter and SM clock read around it: the energy and the
// clock cycles a GEMM takes under the power cap (NVML is opened at run time; without it the phase
// is left out and the JSON says so).
// Every configuration's output is checked against cuBLASLt's at each shape (relative Frobenius
// error <= 1e-2: the two differ by their bf16 rounding only; a wrong layout gives ~1).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mainloop.h"

#define ML_CONFIG(i) mainloop::Entry mainloop_config_##i();
#include "configs.inc"
#undef ML_CONFIG

namespace {

#define CK(expr)                                                                                       \
  do {                                                                                                 \
    cudaError_t e_ = (expr);                                                                           \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));      \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)
#define CKLT(expr)                                                                                     \
  do {                                                                                                 \
    cublasStatus_t s_ = (expr);                                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s: status %d\n", __FILE__, __LINE__, #expr, static_cast<int>(s_)); \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

std::vector<mainloop::Entry> all_configs() {
  std::vector<mainloop::Entry> v;
#define ML_CONFIG(i) v.push_back(mainloop_config_##i());
#include "configs.inc"
#undef ML_CONFIG
  return v;
}

// The roles: the gated fc1 (x [M, d] times W [2h, d]^T, B K-major), the gated data gradient
// (d_out [M, d] times W2 [d, h], B N-major) and the GELU MLP's data gradient (d_out [M, d] times
// W2 [d, 4d]), at the gated and MLP benchmarks' shapes.
struct Problem {
  const char* role;
  int m, n, k;
  bool b_k_major;
};

std::vector<Problem> problems(bool quick) {
  std::vector<Problem> p = {
      {"gated_fc1", 8192, 2 * 5632, 2048, true},    {"gated_fc1", 8192, 2 * 11008, 4096, true},
      {"gated_fc1", 16384, 2 * 14336, 4096, true},  {"gated_dgrad", 8192, 5632, 2048, false},
      {"gated_dgrad", 8192, 11008, 4096, false},    {"gated_dgrad", 16384, 14336, 4096, false},
      {"gelu_dgrad", 8192, 4096, 1024, false},      {"gelu_dgrad", 8192, 8192, 2048, false},
      {"gelu_dgrad", 8192, 16384, 4096, false},     {"gelu_dgrad", 16384, 32768, 8192, false},
  };
  if (quick) p.resize(1);
  return p;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ (seed * 40503u + static_cast<unsigned>(i >> 32));
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16((x & 0xffffff) / float(0x800000) - 1.f);  // uniform in [-1, 1)
  }
}

// sums[0] += (a - b)^2, sums[1] += b^2, in double
__global__ void diff_norms(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, double* sums) {
  double d2 = 0, r2 = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d2 += (x - y) * (x - y);
    r2 += y * y;
  }
  atomicAdd(&sums[0], d2);
  atomicAdd(&sums[1], r2);
}

struct Buffers {
  __nv_bfloat16 *a = nullptr, *b = nullptr, *d = nullptr, *ref = nullptr;
  void* flush = nullptr;
  void* ws = nullptr;
  double* sums = nullptr;
  size_t flush_bytes = 512u << 20, ws_bytes = 64u << 20;  // the flush also covers the host time of a launch
};

// cuBLASLt's view of the same GEMM: column-major D^T[N, M] = op(B)[N, K] * A^T[K, M].
struct Lt {
  cublasLtHandle_t h{};
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, ld{};
  std::vector<cublasLtMatmulAlgo_t> algos;
  Lt(cublasLtHandle_t handle, const Problem& p, size_t ws_bytes) : h(handle) {
    CKLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = p.b_k_major ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (p.b_k_major)
      CKLT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p.k, p.n, p.k));
    else
      CKLT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p.n, p.k, p.n));
    CKLT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.k, p.m, p.k));
    CKLT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, p.n, p.m, p.n));
    cublasLtMatmulPreference_t pref;
    CKLT(cublasLtMatmulPreferenceCreate(&pref));
    CKLT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                              sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    CKLT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 16, res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < found; ++i)
      if (res[i].state == CUBLAS_STATUS_SUCCESS) algos.push_back(res[i].algo);
  }
  ~Lt() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
  bool run(int i, const Buffers& buf, void* d) const {
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(h, desc, &one, buf.b, la, buf.a, lb, &zero, d, ld, d, ld, &algos[i], buf.ws, buf.ws_bytes,
                          0) == CUBLAS_STATUS_SUCCESS;
  }
};

// One candidate: ours (config, order) or cuBLASLt's algorithm `algo`.
struct Candidate {
  std::string name;
  int config = -1, algo = -1;
  mainloop::Order order{0, 1};
  double screen_ms = 0;
  double shortlist_ms = 0;  // the shortlist's median over its interleaved rounds; 0 if not shortlisted
  bool ok = true;
  double error = 0;
};

const mainloop::Order kOrders[] = {{0, 1}, {1, 2}, {1, 4}, {1, 8}, {2, 2}, {2, 4}, {2, 8}};

std::string order_name(mainloop::Order o) {
  return std::string(o.raster == 0 ? "heuristic" : o.raster == 1 ? "M" : "N") + "/" + std::to_string(o.swizzle);
}

struct Harness {
  std::vector<mainloop::Entry> configs;
  Buffers buf;
  Lt* lt = nullptr;
  int sm_count = 0;
  cudaEvent_t e0{}, e1{};

  // The device's SM count, buffers for the largest of `probs` (A and B filled), the timing events.
  void setup(const std::vector<Problem>& probs) {
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    sm_count = prop.multiProcessorCount;
    size_t max_a = 0, max_b = 0, max_d = 0;
    for (const Problem& p : probs) {
      max_a = std::max(max_a, size_t(p.m) * p.k);
      max_b = std::max(max_b, size_t(p.n) * p.k);
      max_d = std::max(max_d, size_t(p.m) * p.n);
    }
    CK(cudaMalloc(&buf.a, max_a * 2));
    CK(cudaMalloc(&buf.b, max_b * 2));
    CK(cudaMalloc(&buf.d, max_d * 2));
    CK(cudaMalloc(&buf.ref, max_d * 2));
    CK(cudaMalloc(&buf.flush, buf.flush_bytes));
    CK(cudaMalloc(&buf.ws, buf.ws_bytes));
    CK(cudaMalloc(&buf.sums, 2 * sizeof(double)));
    fill<<<1024, 256>>>(buf.a, max_a, 1);
    fill<<<1024, 256>>>(buf.b, max_b, 2);
    CK(cudaGetLastError());
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  bool launch(const Candidate& c, const Problem& p, void* d) {
    if (c.algo >= 0) return lt->run(c.algo, buf, d);
    return configs[c.config].run(p.b_k_major, c.order, sm_count, p.m, p.n, p.k, buf.a, buf.b, d, buf.ws,
                                 buf.ws_bytes, 0);
  }
  // The kernel time of one launch after an L2 flush, ms; negative when it did not launch.
  double time_once(const Candidate& c, const Problem& p) {
    CK(cudaMemsetAsync(buf.flush, 0, buf.flush_bytes, 0));
    CK(cudaEventRecord(e0, 0));
    const bool ok = launch(c, p, buf.d);
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ok ? ms : -1;
  }
  double median_of(const Candidate& c, const Problem& p, int n) {
    std::vector<double> t;
    for (int i = 0; i < n; ++i) {
      const double ms = time_once(c, p);
      if (ms < 0) return -1;
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
  double error_against_ref(const Problem& p) {
    CK(cudaMemset(buf.sums, 0, 2 * sizeof(double)));
    diff_norms<<<528, 256>>>(buf.d, buf.ref, size_t(p.m) * p.n, buf.sums);
    CK(cudaGetLastError());
    double s[2];
    CK(cudaMemcpy(s, buf.sums, sizeof s, cudaMemcpyDeviceToHost));
    return std::sqrt(s[0] / s[1]);
  }
};

// The part of NVML the energy phase reads, opened at run time (the driver's libnvidia-ml.so.1;
// this machine's toolkit has no nvml.h, so the four entry points are declared here with NVML's
// types: nvmlReturn_t is an int, 0 on success; a device is an opaque handle; clock type 1 is the
// SM clock).
class Nvml {
 public:
  Nvml() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    energy_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
    shutdown_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"));
    char bus[32] = {};
    if (!init || !by_bus || !energy_ || !clock_ || !shutdown_ || init() != 0) return;
    initialized_ = true;
    unsigned long long mj = 0;
    unsigned mhz = 0;
    ok_ = cudaDeviceGetPCIBusId(bus, sizeof bus, 0) == cudaSuccess && by_bus(bus, &dev_) == 0 &&
          energy_(dev_, &mj) == 0 && clock_(dev_, 1, &mhz) == 0;
  }
  ~Nvml() {
    if (initialized_) shutdown_();
    if (lib_) dlclose(lib_);
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;
  bool ok() const { return ok_; }
  double energy_mj() const {
    unsigned long long mj = 0;
    return energy_(dev_, &mj) == 0 ? static_cast<double>(mj) : -1;
  }
  double sm_mhz() const {
    unsigned mhz = 0;
    return clock_(dev_, 1, &mhz) == 0 ? static_cast<double>(mhz) : -1.0;
  }

 private:
  void* lib_ = nullptr;
  void* dev_ = nullptr;
  bool initialized_ = false, ok_ = false;
  int (*energy_)(void*, unsigned long long*) = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*shutdown_)() = nullptr;
};

// One finalist back to back (no flushes) for `seconds`, hot: per GEMM its time, energy and clock
// cycles, and the mean power and SM clock (sampled after each batch of 20).
struct Energy {
  double ms = 0, mj = 0, watts = 0, sm_mhz = 0, mcycles = 0;
  int gemms = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

// --profile: what ncu reads (e.g. ncu --clock-control none --section SpeedOfLight
// --kernel-name regex:'device_kernel|gemm|nvjet' mainloop_search --profile 1 co_128x256_c2x1_sk/M/2).
int profile_run(Harness& hs, int index, const std::vector<std::string>& names) {
  const std::vector<Problem> probs = problems(false);
  if (index < 0 || index >= static_cast<int>(probs.size()) || names.empty()) {
    std::fprintf(stderr, "--profile P NAME[/ORDER] ...: P in [0, %zu), at least one configuration\n", probs.size());
    return 2;
  }
  const Problem& p = probs[index];
  hs.setup({p});
  Buffers& buf = hs.buf;
  cublasLtHandle_t handle;
  CKLT(cublasLtCreate(&handle));
  Lt lt(handle, p, buf.ws_bytes);
  hs.lt = &lt;
  if (lt.algos.empty() || !lt.run(0, buf, buf.ref)) return 2;
  for (int i = 0; i < 2; ++i) lt.run(0, buf, buf.d);
  CK(cudaDeviceSynchronize());
  std::printf("%s M %d N %d K %d: cuBLASLt's first algorithm launched 3 times\n", p.role, p.m, p.n, p.k);
  int status = 0;
  for (const std::string& full : names) {
    const size_t slash = full.find('/');
    const std::string name = full.substr(0, slash), order = slash == std::string::npos ? "" : full.substr(slash + 1);
    Candidate c;
    c.name = full;
    for (size_t ci = 0; ci < hs.configs.size(); ++ci)
      if (name == hs.configs[ci].config.name) c.config = static_cast<int>(ci);
    bool order_found = order.empty();
    for (mainloop::Order o : kOrders)
      if (order == order_name(o)) c.order = o, order_found = true;
    if (c.config < 0 || !order_found) {
      std::fprintf(stderr, "unknown configuration or order: %s\n", full.c_str());
      status = 2;
      continue;
    }
    CK(cudaMemset(buf.d, 0xff, size_t(p.m) * p.n * 2));
    bool ok = true;
    for (int i = 0; i < 3; ++i) ok = ok && hs.launch(c, p, buf.d);
    CK(cudaDeviceSynchronize());
    const double err = ok ? hs.error_against_ref(p) : -1;
    std::printf("%s: %s, relative error %.3e\n", full.c_str(), ok ? "launched 3 times" : "REFUSED", err);
    if (!ok || !(err <= 1e-2)) status = 1;
  }
  cublasLtDestroy(handle);
  return status;
}

int main(int argc, char** argv) {
  const char* out_path = "mainloop.json";
  int rounds = 7;
  double sustain_s = 20, energy_s = 0.5;
  bool quick = false;
  std::vector<int> only;  // --problems: indices into the list, in its order
  int profile = -1;
  std::vector<std::string> profile_names;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (profile >= 0 && a.rfind("--", 0) != 0) profile_names.push_back(a);
    else if (a == "--profile" && i + 1 < argc) profile = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--rounds" && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (a == "--sustain-s" && i + 1 < argc) sustain_s = std::atof(argv[++i]);
    else if (a == "--energy-s" && i + 1 < argc) energy_s = std::atof(argv[++i]);
    else if (a == "--quick") quick = true;
    else if (a == "--problems" && i + 1 < argc) {
      for (const char* p = argv[++i]; *p != '\0';) {
        char* end = nullptr;
        only.push_back(static_cast<int>(std::strtol(p, &end, 10)));
        if (end == p) {
          std::fprintf(stderr, "--problems: comma-separated indices expected, got '%s'\n", argv[i]);
          return 2;
        }
        p = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--out FILE.json] [--rounds R] [--sustain-s S] [--energy-s E] "
                   "[--quick | --problems I,J,...]\n",
                   argv[0]);
      return 2;
    }
  }
  Harness hs;
  hs.configs = all_configs();
  if (profile >= 0) return profile_run(hs, profile, profile_names);
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  std::vector<Problem> probs = problems(quick);
  if (!only.empty()) {
    const std::vector<Problem> all = probs;
    probs.clear();
    for (int i : only) {
      if (i < 0 || i >= static_cast<int>(all.size())) {
        std::fprintf(stderr, "--problems: index %d outside [0, %zu)\n", i, all.size());
        return 2;
      }
      probs.push_back(all[i]);
    }
  }
  hs.setup(probs);
  Buffers& buf = hs.buf;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cublasLtHandle_t handle;
  CKLT(cublasLtCreate(&handle));

  FILE* f = std::fopen(out_path, "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", out_path);
    return 2;
  }
  std::fprintf(f, "{\"gpu\": \"%s\", \"sm_count\": %d, \"driver\": %d, \"cuda_runtime\": %d, \"cublaslt\": %zu, ",
               prop.name, hs.sm_count, driver, runtime, cublasLtGetVersion());
  Nvml nvml;
  const bool energy = energy_s > 0 && nvml.ok();
  if (energy_s > 0 && !energy) std::printf("NVML unavailable: the energy phase is left out\n");
  std::fprintf(f, "\"rounds\": %d, \"sustain_s\": %g, \"energy_s\": %g, \"configs\": [", rounds, sustain_s,
               energy ? energy_s : 0.0);
  for (size_t i = 0; i < hs.configs.size(); ++i) {
    const mainloop::Config& c = hs.configs[i].config;
    std::fprintf(f, "%s{\"name\": \"%s\", \"tile\": [%d, %d, %d], \"cluster\": [%d, %d], \"schedule\": \"%s\", "
                 "\"scheduler\": \"%s\", \"smem_bytes\": %d, \"stages\": %d, \"epilogue_tile\": [%d, %d]}",
                 i ? ", " : "", c.name, c.tile_m, c.tile_n, c.tile_k, c.cluster_m, c.cluster_n,
                 c.cooperative ? "cooperative" : "pingpong", c.stream_k ? "stream-k" : "persistent", c.smem_bytes,
                 c.stages, c.epi_m, c.epi_n);
  }
  std::fprintf(f, "], \"problems\": [");
  std::printf("%s, %d SMs, driver %d, runtime %d, cuBLASLt %zu; %zu configurations x %zu orders\n", prop.name,
              hs.sm_count, driver, runtime, cublasLtGetVersion(), hs.configs.size(), std::size(kOrders));

  for (size_t pi = 0; pi < probs.size(); ++pi) {
    const Problem& p = probs[pi];
    Lt lt(handle, p, buf.ws_bytes);
    hs.lt = &lt;
    const double flop = 2.0 * p.m * p.n * p.k;
    std::printf("\n== %s M %d N %d K %d (B %s-major): %zu cuBLASLt algorithms\n", p.role, p.m, p.n, p.k,
                p.b_k_major ? "K" : "N", lt.algos.size());
    std::fflush(stdout);
    if (lt.algos.empty()) {
      std::fprintf(stderr, "cuBLASLt offers no algorithm\n");
      return 2;
    }
    // the reference output: cuBLASLt's first algorithm
    if (!lt.run(0, buf, buf.ref)) return 2;
    CK(cudaDeviceSynchronize());
    // screening
    std::vector<Candidate> ours, theirs;
    for (size_t a = 0; a < lt.algos.size(); ++a) {
      Candidate c;
      c.name = "cublaslt#" + std::to_string(a);
      c.algo = static_cast<int>(a);
      c.screen_ms = hs.median_of(c, p, 5);
      if (c.screen_ms > 0) theirs.push_back(c);
    }
    for (size_t ci = 0; ci < hs.configs.size(); ++ci)
      for (mainloop::Order o : kOrders) {
        Candidate c;
        c.name = std::string(hs.configs[ci].config.name) + " " + order_name(o);
        c.config = static_cast<int>(ci);
        c.order = o;
        CK(cudaMemset(buf.d, 0xff, size_t(p.m) * p.n * 2));  // poisoned: NaN
        c.screen_ms = hs.median_of(c, p, 5);
        c.ok = c.screen_ms > 0;
        if (c.ok) {
          c.error = hs.error_against_ref(p);
          if (!(c.error <= 1e-2)) {
            std::printf("  WRONG RESULT: %s, relative error %.3e\n", c.name.c_str(), c.error);
            c.ok = false;
          }
        }
        ours.push_back(c);
      }
    std::sort(theirs.begin(), theirs.end(), [](auto& x, auto& y) { return x.screen_ms < y.screen_ms; });
    std::vector<Candidate> good;
    for (auto& c : ours)
      if (c.ok) good.push_back(c);
    std::sort(good.begin(), good.end(), [](auto& x, auto& y) { return x.screen_ms < y.screen_ms; });
    std::printf("  screening (median of 5): cuBLASLt first %.3f ms, fastest %.3f ms (%s); ours fastest %.3f ms (%s)\n",
                [&] { for (auto& c : theirs) if (c.algo == 0) return c.screen_ms; return 0.0; }(), theirs[0].screen_ms,
                theirs[0].name.c_str(), good.empty() ? 0.0 : good[0].screen_ms,
                good.empty() ? "-" : good[0].name.c_str());
    // the final rounds
    std::vector<Candidate> finalists;
    Candidate first;
    first.name = "cublaslt_first";
    first.algo = 0;
    finalists.push_back(first);
    Candidate fastest = theirs[0];
    fastest.name = "cublaslt_fastest";
    finalists.push_back(fastest);
    // the shortlist, re-timed in interleaved rounds, ranks the finalists
    const size_t shortlist = std::min<size_t>(good.size(), 12);
    {
      std::vector<std::vector<double>> t(shortlist);
      for (int r = 0; r < 3; ++r)
        for (size_t i = 0; i < shortlist; ++i) {
          const size_t j = (i + r * 5) % shortlist;  // a different order each round
          t[j].push_back(hs.median_of(good[j], p, 5));
        }
      for (size_t i = 0; i < shortlist; ++i) good[i].shortlist_ms = median(t[i]);
      std::sort(good.begin(), good.begin() + shortlist,
                [](auto& x, auto& y) { return x.shortlist_ms < y.shortlist_ms; });
      for (auto& c : ours)
        for (size_t i = 0; i < shortlist; ++i)
          if (c.name == good[i].name) c.shortlist_ms = good[i].shortlist_ms;
      if (shortlist > 0)
        std::printf("  shortlist of %zu (3 interleaved rounds): best %s %.3f ms (screened %.3f)\n", shortlist,
                    good[0].name.c_str(), good[0].shortlist_ms, good[0].screen_ms);
    }
    for (size_t i = 0; i < shortlist && i < 3; ++i) finalists.push_back(good[i]);
    std::vector<std::vector<double>> full(finalists.size()), sustained(finalists.size());
    for (int phase = 0; phase < 2; ++phase) {
      if (phase == 1) {  // sustained load: the largest finalist GEMM back to back
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < sustain_s) {
          for (int i = 0; i < 20; ++i) lt.run(0, buf, buf.d);
          CK(cudaDeviceSynchronize());
        }
      } else {
        CK(cudaDeviceSynchronize());
        std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 2.0) {
        }  // idle: the clock recovers
      }
      for (int r = 0; r < rounds; ++r)
        for (size_t i = 0; i < finalists.size(); ++i) {
          const size_t j = (i + r) % finalists.size();  // rotate the order each round
          (phase ? sustained : full)[j].push_back(hs.median_of(finalists[j], p, 10));
        }
    }
    // hot, right after the sustained rounds: each finalist back to back, the order rotated per shape
    std::vector<Energy> joules(finalists.size());
    for (size_t i = 0; energy && i < finalists.size(); ++i) {
      const size_t j = (i + pi) % finalists.size();
      for (int w = 0; w < 20; ++w) hs.launch(finalists[j], p, buf.d);
      CK(cudaDeviceSynchronize());
      std::vector<double> mhz;
      Energy& e = joules[j];
      const double mj0 = nvml.energy_mj();
      const auto t0 = std::chrono::steady_clock::now();
      double secs = 0;
      while (secs < energy_s) {
        for (int b = 0; b < 20; ++b) hs.launch(finalists[j], p, buf.d);
        CK(cudaDeviceSynchronize());
        e.gemms += 20;
        mhz.push_back(nvml.sm_mhz());
        secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      const double mj1 = nvml.energy_mj();
      e.ms = secs * 1e3 / e.gemms;
      e.mj = (mj1 - mj0) / e.gemms;
      e.watts = (mj1 - mj0) * 1e-3 / secs;
      e.sm_mhz = median(mhz);
      e.mcycles = e.ms * e.sm_mhz * 1e-3;
    }
    const double base_full = median(full[0]), base_sus = median(sustained[0]);
    const double best_full = median(full[1]), best_sus = median(sustained[1]);
    std::fprintf(f, "%s{\"role\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, \"b_k_major\": %s, \"cublaslt_algorithms\": %zu, ",
                 pi ? ", " : "", p.role, p.m, p.n, p.k, p.b_k_major ? "true" : "false", lt.algos.size());
    std::fprintf(f, "\"screen\": [");
    for (size_t i = 0; i < theirs.size(); ++i)
      std::fprintf(f, "%s{\"name\": \"%s\", \"ms\": %.5f}", i ? ", " : "", theirs[i].name.c_str(), theirs[i].screen_ms);
    for (const auto& c : ours)
      std::fprintf(f, ", {\"name\": \"%s\", \"config\": %d, \"raster\": %d, \"swizzle\": %d, \"ms\": %.5f, "
                   "\"shortlist_ms\": %.5f, \"ok\": %s, \"error\": %.3e}", c.name.c_str(), c.config,
                   c.order.raster, c.order.swizzle, c.ok ? c.screen_ms : -1.0, c.shortlist_ms,
                   c.ok ? "true" : "false", c.error);
    std::fprintf(f, "], \"final\": [");
    std::printf("  %-36s %10s %8s %9s %10s %8s %9s\n", "final (median of rounds)", "full ms", "TFLOP/s", "/cuBLASLt",
                "sustain ms", "TFLOP/s", "/cuBLASLt");
    for (size_t i = 0; i < finalists.size(); ++i) {
      const double mf = median(full[i]), ms = median(sustained[i]);
      std::printf("  %-36s %10.4f %8.1f %9.3f %10.4f %8.1f %9.3f\n", finalists[i].name.c_str(), mf, flop / mf * 1e-9,
                  mf / best_full, ms, flop / ms * 1e-9, ms / best_sus);
      std::fprintf(f, "%s{\"name\": \"%s\", \"config\": %d, \"raster\": %d, \"swizzle\": %d, \"full_ms\": %.5f, "
                   "\"sustained_ms\": %.5f, ", i ? ", " : "", finalists[i].name.c_str(),
                   finalists[i].config, finalists[i].order.raster, finalists[i].order.swizzle, mf, ms);
      if (energy) {
        const Energy& e = joules[i];
        std::printf("  %-36s back to back %.4f ms, %.2f mJ, %.0f W, SM %.0f MHz, %.3f Mcycles per GEMM\n", "",
                    e.ms, e.mj, e.watts, e.sm_mhz, e.mcycles);
        std::fprintf(f, "\"energy\": {\"ms\": %.5f, \"mj\": %.4f, \"watts\": %.1f, \"sm_mhz\": %.0f, "
                     "\"mcycles\": %.5f, \"gemms\": %d}, ", e.ms, e.mj, e.watts, e.sm_mhz, e.mcycles, e.gemms);
      }
      std::fprintf(f, "\"full_rounds\": [");
      for (size_t r = 0; r < full[i].size(); ++r) std::fprintf(f, "%s%.5f", r ? ", " : "", full[i][r]);
      std::fprintf(f, "], \"sustained_rounds\": [");
      for (size_t r = 0; r < sustained[i].size(); ++r) std::fprintf(f, "%s%.5f", r ? ", " : "", sustained[i][r]);
      std::fprintf(f, "]}");
    }
    std::fprintf(f, "], \"cublaslt_first_full_ms\": %.5f, \"cublaslt_first_sustained_ms\": %.5f}", base_full, base_sus);
    std::fflush(f);
    std::fflush(stdout);
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  std::printf("\nwrote %s\n", out_path);
  return 0;
}
