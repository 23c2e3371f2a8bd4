// Standalone check of the gated-MLP kernels (csrc/core/cutlass_sm90/cutlass_sm90_gated.h) against a host fp64
// reference of the same computation (no PyTorch), and their timings next to cuBLASLt's plain GEMM
// of the same size.
//
// Build (from the repository root; extra arguments go to nvcc, e.g. -lineinfo for the sanitizers):
//   bash tests/native/build_gated.sh build/test_gated_cutlass
// Run:  build/test_gated_cutlass             every shape, dtype, activation and variant, then timings
//       build/test_gated_cutlass --no-bench  the correctness suite only
//       build/test_gated_cutlass --sanitize  three small shapes, every optional output written,
//                                            buffers of their exact size, no timings (for
//                                            compute-sanitizer memcheck / racecheck)
//       --bf16-only                          with any of the above: bf16 cases only
//       --shape B,d,h                        a timed shape (repeatable; default 8192,4096,11008)
//       --bench-only                         the timed shapes and their checks only
// Prints "N passed, M failed"; exits 1 on a failure, 77 when the device is not compute
// capability 9.0 or the kernels are not compiled in.
//
// Every case fills its outputs with NaN (all bits set, a NaN in fp16 and bf16) before the launch,
// so an element the kernel does not write fails the comparison, and (outside --sanitize) checks
// that 256 bytes past the end of each output stay untouched. Tolerances on ||out - ref|| / ||ref||:
// bf16 1e-2, fp16 2e-3 (the outputs are rounded once from fp32).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "core/cutlass_sm90/cutlass_sm90_gated.h"
#include "core/common/device_info.h"
#include "core/gemm/gemm.h"
#include "core/common/types.h"

using namespace fused_dense::core;

namespace {

#define CK(expr)                                                                                          \
  do {                                                                                                    \
    cudaError_t e_ = (expr);                                                                              \
    if (e_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s (case %s)\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   #expr, g_current.c_str());                                                             \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

#define CKLT(expr)                                                                          \
  do {                                                                                      \
    cublasStatus_t s_ = (expr);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      std::fprintf(stderr, "cuBLASLt status %d at %s:%d: %s\n", static_cast<int>(s_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

std::string g_current;
int g_passed = 0, g_failed = 0;
bool g_exact_alloc = false;  // --sanitize: no slack after the buffers
bool g_bench_only = false;   // --bench-only: the timed shapes' checks only
int g_device = 0;
constexpr size_t kCanary = 256;
// What each kernel offers for a fitting problem: 3 tile configurations x 3 scheduler orders.
constexpr int kVariants = 9;

void record(bool ok, const std::string& detail) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    if (g_failed <= 80) std::printf("FAIL %s %s\n", g_current.c_str(), detail.c_str());
  }
}

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * ((next() >> 11) * (1.0 / (1ull << 53))); }
};

// 16-bit host values: bits as the device sees them, and their exact value as double.
uint16_t to_bits(DType t, float v) {
  uint16_t b;
  if (t == DType::kFloat16) {
    __half h = __float2half_rn(v);
    std::memcpy(&b, &h, 2);
  } else {
    __nv_bfloat16 h = __float2bfloat16_rn(v);
    std::memcpy(&b, &h, 2);
  }
  return b;
}

double from_bits(DType t, uint16_t b) {
  if (t == DType::kFloat16) {
    __half h;
    std::memcpy(&h, &b, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &b, 2);
  return __bfloat162float(h);
}

struct Host16 {
  std::vector<uint16_t> bits;
  std::vector<double> val;
};

Host16 random16(DType t, size_t n, double lo, double hi, Rng& rng) {
  Host16 h;
  h.bits.resize(n);
  h.val.resize(n);
  for (size_t i = 0; i < n; ++i) {
    h.bits[i] = to_bits(t, static_cast<float>(rng.uniform(lo, hi)));
    h.val[i] = from_bits(t, h.bits[i]);
  }
  return h;
}

// A device buffer of n 16-bit elements (plus kCanary bytes of slack outside --sanitize).
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : bytes(2 * n) { CK(cudaMalloc(&p, bytes + (g_exact_alloc ? 0 : kCanary))); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void upload(const std::vector<uint16_t>& v) { CK(cudaMemcpy(p, v.data(), bytes, cudaMemcpyHostToDevice)); }
  void poison() { CK(cudaMemset(p, 0xFF, bytes + (g_exact_alloc ? 0 : kCanary))); }
  // The slack past the end still all 0xFF (only meaningful after poison()).
  bool canary_intact() const {
    if (g_exact_alloc) return true;
    std::vector<uint8_t> t(kCanary);
    CK(cudaMemcpy(t.data(), static_cast<char*>(p) + bytes, kCanary, cudaMemcpyDeviceToHost));
    return std::all_of(t.begin(), t.end(), [](uint8_t b) { return b == 0xFF; });
  }
};

// ----------------------------------------------------------------------------------------------
// fp64 reference of the gated activations (SiLU; GELU tanh approximation).

double gate_act_ref(Activation a, double g) {
  if (a == Activation::kSwiGLU) return g / (1.0 + std::exp(-g));
  const double k = 0.79788456080286535588;  // sqrt(2 / pi)
  return 0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g)));
}

double gate_act_derivative_ref(Activation a, double g) {
  if (a == Activation::kSwiGLU) {
    const double s = 1.0 / (1.0 + std::exp(-g));
    return s + g * s * (1.0 - s);
  }
  const double k = 0.79788456080286535588;  // sqrt(2 / pi)
  const double t = std::tanh(k * (g + 0.044715 * g * g * g));
  return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g);
}

const char* act_name(Activation a) { return a == Activation::kSwiGLU ? "swiglu" : "geglu"; }
const char* dtype_str(DType t) { return t == DType::kBFloat16 ? "bf16" : "fp16"; }
double tolerance(DType t) { return t == DType::kBFloat16 ? 1e-2 : 2e-3; }

// Packed layout (types.h): column of the gate / up of unit j in a row of gu.
int64_t gate_col(int64_t j) { return (j / kGatedInterleave) * 2 * kGatedInterleave + j % kGatedInterleave; }
int64_t up_col(int64_t j) { return gate_col(j) + kGatedInterleave; }

// ||got - ref|| / ||ref|| over the elements added (NaN when any got is NaN).
struct RelErr {
  double num = 0, den = 0;
  void add(double got, double ref) {
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  double value() const { return std::sqrt(num / std::max(den, 1e-300)); }
};

bool check_err(const char* what, const RelErr& e, DType t) {
  const double v = e.value();
  const bool ok = v <= tolerance(t);  // false for NaN
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s rel err %.3e (tol %.0e)", what, v, tolerance(t));
  record(ok, buf);
  return ok;
}

// ----------------------------------------------------------------------------------------------
// Forward: out = act(g) * u, gu = x @ W^T.

CutlassSm90GatedForwardArgs forward_args(int64_t b, int64_t d, int64_t h, DType t, Activation act, const void* x,
                                         const void* w, void* out, void* gu) {
  CutlassSm90GatedForwardArgs a;
  a.device = g_device;
  a.batch = b;
  a.in_features = d;
  a.hidden = h;
  a.dtype = t;
  a.activation = act;
  a.input = x;
  a.weight = w;
  a.out = out;
  a.gu = gu;
  return a;
}

struct ForwardProblem {
  int64_t b, d, h;
  DType t;
  Host16 x, w;
  std::vector<double> gu;  // fp64 x @ W^T [b, 2h] of the rounded inputs (rows in `rows` only)
  std::vector<int64_t> rows;
};

ForwardProblem make_forward(int64_t b, int64_t d, int64_t h, DType t, Rng& rng, const std::vector<int64_t>& rows) {
  ForwardProblem p{b, d, h, t, {}, {}, {}, rows};
  p.x = random16(t, b * d, -1.0, 1.0, rng);
  const double s = 3.0 / std::sqrt(static_cast<double>(d));  // gu of unit variance
  p.w = random16(t, 2 * h * d, -s, s, rng);
  p.gu.assign(rows.size() * 2 * h, 0.0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const double* xr = &p.x.val[rows[r] * d];
    for (int64_t c = 0; c < 2 * h; ++c) {
      const double* wc = &p.w.val[c * d];
      double acc[4] = {0, 0, 0, 0};  // independent sums (d % 8 == 0), so the loop is not one add chain
      for (int64_t k = 0; k < d; k += 4)
        for (int i = 0; i < 4; ++i) acc[i] += xr[k + i] * wc[k + i];
      p.gu[r * 2 * h + c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
  return p;
}

std::vector<int64_t> all_rows(int64_t b) {
  std::vector<int64_t> r(b);
  for (int64_t i = 0; i < b; ++i) r[i] = i;
  return r;
}

// Reads rows `rows` of a [b, cols] 16-bit device matrix.
std::vector<uint16_t> download_rows(const Dev& buf, int64_t cols, const std::vector<int64_t>& rows) {
  std::vector<uint16_t> v(rows.size() * cols);
  if (rows.size() * cols * 2 == buf.bytes && rows.back() == static_cast<int64_t>(rows.size()) - 1) {
    CK(cudaMemcpy(v.data(), buf.p, buf.bytes, cudaMemcpyDeviceToHost));  // all rows, in order
    return v;
  }
  for (size_t r = 0; r < rows.size(); ++r)
    CK(cudaMemcpy(&v[r * cols], static_cast<const uint16_t*>(buf.p) + rows[r] * cols, 2 * cols,
                  cudaMemcpyDeviceToHost));
  return v;
}

void test_forward(const ForwardProblem& p, const Workspace& ws) {
  Dev x(p.b * p.d), w(2 * p.h * p.d), out(p.b * p.h), gu(p.b * 2 * p.h);
  x.upload(p.x.bits);
  w.upload(p.w.bits);
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU}) {
    CutlassSm90GatedForwardArgs a = forward_args(p.b, p.d, p.h, p.t, act, x.p, w.p, out.p, gu.p);
    const int variants = cutlass_sm90_gated_forward_variants(a);
    char name[200];
    std::snprintf(name, sizeof name, "forward B=%lld d=%lld h=%lld %s %s", (long long)p.b, (long long)p.d,
                  (long long)p.h, dtype_str(p.t), act_name(act));
    g_current = name;
    record(variants == kVariants, "variant count " + std::to_string(variants));
    for (int v = 0; v < variants; ++v) {
      for (bool store_gu : {true, false}) {
        if (g_exact_alloc && !store_gu) continue;  // --sanitize: the mode that writes the most
        std::snprintf(name, sizeof name, "forward B=%lld d=%lld h=%lld %s %s variant %d%s", (long long)p.b,
                      (long long)p.d, (long long)p.h, dtype_str(p.t), act_name(act), v, store_gu ? " +gu" : "");
        g_current = name;
        a.gu = store_gu ? gu.p : nullptr;
        out.poison();
        gu.poison();
        const bool launched = cutlass_sm90_gated_forward(v, a, ws, 0);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        record(launched, "not launched");
        if (!launched) continue;
        const std::vector<uint16_t> o = download_rows(out, p.h, p.rows);
        RelErr e_out, e_gu;
        for (size_t r = 0; r < p.rows.size(); ++r)
          for (int64_t j = 0; j < p.h; ++j) {
            const double g = p.gu[r * 2 * p.h + gate_col(j)], u = p.gu[r * 2 * p.h + up_col(j)];
            e_out.add(from_bits(p.t, o[r * p.h + j]), gate_act_ref(act, g) * u);
          }
        check_err("out", e_out, p.t);
        record(out.canary_intact(), "out written past its end");
        if (store_gu) {
          const std::vector<uint16_t> q = download_rows(gu, 2 * p.h, p.rows);
          for (size_t i = 0; i < q.size(); ++i) e_gu.add(from_bits(p.t, q[i]), p.gu[i]);
          check_err("gu", e_gu, p.t);
          record(gu.canary_intact(), "gu written past its end");
        } else {
          // gu == nullptr: the buffer must be left as poisoned
          const std::vector<uint16_t> q = download_rows(gu, 2 * p.h, p.rows);
          record(std::all_of(q.begin(), q.end(), [](uint16_t b) { return b == 0xFFFF; }), "gu written while null");
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Data gradient: d_h = d_out @ W2, d_g = d_h u act'(g), d_u = d_h act(g), h = act(g) u.

CutlassSm90GatedDgradArgs dgrad_args(int64_t b, int64_t h, int64_t n, DType t, Activation act, const void* d_out,
                                     const void* w2, const void* gu, void* d_gu) {
  CutlassSm90GatedDgradArgs a;
  a.device = g_device;
  a.batch = b;
  a.hidden = h;
  a.out_features = n;
  a.dtype = t;
  a.activation = act;
  a.d_output = d_out;
  a.weight = w2;
  a.gu = gu;
  a.d_gu = d_gu;
  return a;
}

struct DgradProblem {
  int64_t b, h, n;
  DType t;
  Host16 d_out, w2, gu;
  std::vector<double> d_h;  // [rows, h]
  std::vector<int64_t> rows;
};

DgradProblem make_dgrad(int64_t b, int64_t h, int64_t n, DType t, Rng& rng, const std::vector<int64_t>& rows) {
  DgradProblem p{b, h, n, t, {}, {}, {}, {}, rows};
  p.d_out = random16(t, b * n, -1.0, 1.0, rng);
  const double s = 3.0 / std::sqrt(static_cast<double>(n));
  p.w2 = random16(t, n * h, -s, s, rng);
  p.gu = random16(t, b * 2 * h, -4.0, 4.0, rng);
  p.d_h.assign(rows.size() * h, 0.0);
  std::vector<double> acc(h);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < n; ++k) {
      const double dy = p.d_out.val[rows[r] * n + k];
      const double* wk = &p.w2.val[k * h];
      for (int64_t j = 0; j < h; ++j) acc[j] += dy * wk[j];
    }
    std::copy(acc.begin(), acc.end(), &p.d_h[r * h]);
  }
  return p;
}

void test_dgrad(const DgradProblem& p, const Workspace& ws) {
  Dev d_out(p.b * p.n), w2(p.n * p.h), gu(p.b * 2 * p.h), d_gu(p.b * 2 * p.h), h_out(p.b * p.h);
  d_out.upload(p.d_out.bits);
  w2.upload(p.w2.bits);
  gu.upload(p.gu.bits);
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU}) {
    CutlassSm90GatedDgradArgs a = dgrad_args(p.b, p.h, p.n, p.t, act, d_out.p, w2.p, gu.p, d_gu.p);
    const int variants = cutlass_sm90_gated_dgrad_variants(a);
    char name[220];
    std::snprintf(name, sizeof name, "dgrad B=%lld h=%lld N=%lld %s %s", (long long)p.b, (long long)p.h,
                  (long long)p.n, dtype_str(p.t), act_name(act));
    g_current = name;
    record(variants == kVariants, "variant count " + std::to_string(variants));
    // modes: 0 act_out written, 1 act_out null, 2 in place (d_gu == gu) with act_out
    for (int v = 0; v < variants; ++v) {
      for (int mode = 0; mode < (g_exact_alloc ? 1 : 3); ++mode) {  // --sanitize: the mode that writes the most
        std::snprintf(name, sizeof name, "dgrad B=%lld h=%lld N=%lld %s %s variant %d %s", (long long)p.b,
                      (long long)p.h, (long long)p.n, dtype_str(p.t), act_name(act), v,
                      mode == 0 ? "+h" : mode == 1 ? "no h" : "in place +h");
        g_current = name;
        d_gu.poison();
        h_out.poison();
        if (mode == 2) CK(cudaMemcpy(d_gu.p, gu.p, d_gu.bytes, cudaMemcpyDeviceToDevice));
        a.gu = mode == 2 ? d_gu.p : gu.p;
        a.d_gu = d_gu.p;
        a.act_out = mode == 1 ? nullptr : h_out.p;
        const bool launched = cutlass_sm90_gated_dgrad(v, a, ws, 0);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        record(launched, "not launched");
        if (!launched) continue;
        const std::vector<uint16_t> dq = download_rows(d_gu, 2 * p.h, p.rows);
        const std::vector<uint16_t> hq = download_rows(h_out, p.h, p.rows);
        RelErr e_dg, e_du, e_h;
        for (size_t r = 0; r < p.rows.size(); ++r) {
          const int64_t row = p.rows[r];
          for (int64_t j = 0; j < p.h; ++j) {
            const double g = p.gu.val[row * 2 * p.h + gate_col(j)], u = p.gu.val[row * 2 * p.h + up_col(j)];
            const double dh = p.d_h[r * p.h + j];
            e_dg.add(from_bits(p.t, dq[r * 2 * p.h + gate_col(j)]), dh * u * gate_act_derivative_ref(act, g));
            e_du.add(from_bits(p.t, dq[r * 2 * p.h + up_col(j)]), dh * gate_act_ref(act, g));
            e_h.add(from_bits(p.t, hq[r * p.h + j]), gate_act_ref(act, g) * u);
          }
        }
        check_err("d_g", e_dg, p.t);
        check_err("d_u", e_du, p.t);
        record(d_gu.canary_intact(), "d_gu written past its end");
        if (mode != 1) {
          check_err("h", e_h, p.t);
          record(h_out.canary_intact(), "h written past its end");
        } else {
          record(std::all_of(hq.begin(), hq.end(), [](uint16_t b) { return b == 0xFFFF; }), "h written while null");
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// What must offer no variant (the unfused path runs instead).

void test_refusals(const Workspace& ws) {
  g_current = "refusals";
  Dev x(64 * 64), w(2 * 64 * 64), out(64 * 64 + 8), gu(64 * 128 + 8);
  const CutlassSm90GatedForwardArgs f =
      forward_args(64, 64, 64, DType::kBFloat16, Activation::kSwiGLU, x.p, w.p, out.p, gu.p);
  record(cutlass_sm90_gated_forward_variants(f) == kVariants, "fitting forward refused");
  auto refused = [&](CutlassSm90GatedForwardArgs c, const char* what) {
    record(cutlass_sm90_gated_forward_variants(c) == 0 && !cutlass_sm90_gated_forward(0, c, ws, 0),
           std::string("forward not refused: ") + what);
  };
  CutlassSm90GatedForwardArgs c = f;
  c.hidden = 60;
  refused(c, "h % 8 != 0");
  c = f;
  c.hidden = 68;  // a multiple of 4, not of the interleave
  refused(c, "h = 68");
  c = f;
  c.in_features = 60;
  refused(c, "d % 8 != 0");
  c = f;
  c.dtype = DType::kFloat32;
  refused(c, "fp32");
  c = f;
  c.activation = Activation::kGeluTanh;
  refused(c, "not gated");
  c = f;
  c.out = static_cast<char*>(out.p) + 2;
  refused(c, "misaligned out");
  c = f;
  c.gu = static_cast<char*>(gu.p) + 8;
  refused(c, "misaligned gu");
  c = f;
  c.out = nullptr;
  refused(c, "no out");
  record(!cutlass_sm90_gated_forward(kVariants, f, ws, 0) && !cutlass_sm90_gated_forward(-1, f, ws, 0),
         "variant out of range launched");

  const CutlassSm90GatedDgradArgs d =
      dgrad_args(64, 64, 64, DType::kBFloat16, Activation::kGeGLU, x.p, w.p, gu.p, gu.p);
  record(cutlass_sm90_gated_dgrad_variants(d) == kVariants, "fitting dgrad refused");
  auto refused_d = [&](CutlassSm90GatedDgradArgs c2, const char* what) {
    record(cutlass_sm90_gated_dgrad_variants(c2) == 0 && !cutlass_sm90_gated_dgrad(0, c2, ws, 0),
           std::string("dgrad not refused: ") + what);
  };
  CutlassSm90GatedDgradArgs e = d;
  e.hidden = 12;
  refused_d(e, "h % 8 != 0");
  e = d;
  e.gu = nullptr;
  refused_d(e, "no gu");
  e = d;
  e.d_gu = nullptr;
  refused_d(e, "no d_gu");
  e = d;
  e.act_out = static_cast<char*>(out.p) + 4;
  refused_d(e, "misaligned act_out");
  e = d;
  e.out_features = 20;
  refused_d(e, "N % 8 != 0");
  CK(cudaDeviceSynchronize());
}

// ----------------------------------------------------------------------------------------------
// Timings: each variant at 8192 x 4096 -> 11008 beside cuBLASLt's plain GEMM of the same size.

// D col-major [m, n] = op(A)[m, k] * B[k, n], fp32 accumulate, the first heuristic algorithm.
struct LtGemm {
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, ld{};
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
  LtGemm(DType t, bool trans_a, int64_t m, int64_t n, int64_t k, size_t ws_bytes) {
    const cudaDataType dt = t == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
    CKLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    CKLT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    CKLT(cublasLtMatrixLayoutCreate(&la, dt, trans_a ? k : m, trans_a ? m : k, trans_a ? k : m));
    CKLT(cublasLtMatrixLayoutCreate(&lb, dt, k, n, k));
    CKLT(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
    cublasLtMatmulPreference_t pref;
    CKLT(cublasLtMatmulPreferenceCreate(&pref));
    CKLT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                              sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    CKLT(cublasLtMatmulAlgoGetHeuristic(device_info(g_device).cublaslt(), desc, la, lb, ld, ld, pref, 1, &res,
                                        &found));
    cublasLtMatmulPreferenceDestroy(pref);
    ok = found > 0;
    algo = res.algo;
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
  void run(const void* a, const void* b, void* d, const Workspace& ws) const {
    const float one = 1.f, zero = 0.f;
    CKLT(cublasLtMatmul(device_info(g_device).cublaslt(), desc, &one, a, la, b, lb, &zero, d, ld, d, ld, &algo, ws.ptr,
                        ws.bytes, 0));
  }
};

template <class F>
double time_ms(F&& f, int iters = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) f();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  CK(cudaGetLastError());
  return ms / iters;
}

// 0 (and a line saying so) when cuBLASLt offers no algorithm.
double time_baseline(const char* what, const LtGemm& g, const void* a, const void* b, void* d, const Workspace& ws,
                     double flop) {
  if (!g.ok) {
    std::printf("  %s: no cuBLASLt algorithm\n", what);
    return 0;
  }
  const double ms = time_ms([&] { g.run(a, b, d, ws); });
  std::printf("  %-38s %8.3f ms  %6.1f TFLOP/s\n", what, ms, flop / ms * 1e-9);
  return ms;
}

// The memory floor of the unfused path's elementwise pass: a device-to-device copy that reads and
// writes `values` 16-bit values in all (what the pass reads plus what it writes), printed with
// the GEMM's time added.
void time_traffic(const char* what, int64_t values, const Dev& from, Dev& to, double gemm_ms) {
  const size_t bytes = static_cast<size_t>(values);  // half of them read, half written, 2 bytes each
  if (bytes > from.bytes || bytes > to.bytes) {
    std::printf("  %s: copy buffers too small\n", what);
    return;
  }
  const double ms = time_ms([&] { CK(cudaMemcpyAsync(to.p, from.p, bytes, cudaMemcpyDeviceToDevice, 0)); });
  std::printf("  %-38s %8.3f ms  (copy of equal traffic; + GEMM %.3f ms = %.3fx cuBLASLt)\n", what, ms,
              gemm_ms + ms, gemm_ms > 0 ? (gemm_ms + ms) / gemm_ms : 0.0);
}

void print_timing(const char* kernel, Activation act, int variant, const char* extra, double ms, double flop,
                  double base_ms) {
  std::printf("  %-8s %-6s variant %d %-10s     %8.3f ms  %6.1f TFLOP/s  %.3fx cuBLASLt\n", kernel, act_name(act),
              variant, extra, ms, flop / ms * 1e-9, base_ms > 0 ? ms / base_ms : 0.0);
}

struct BenchShape {
  int64_t b, d, h;
};

void bench(DType t, const BenchShape& shape, const Workspace& ws, Rng& rng) {
  const int64_t b = shape.b, d = shape.d, h = shape.h;
  std::printf("\n== %s, B %lld, d %lld, h %lld (fc1: [%lld x %lld] x [%lld x %lld]^T; "
              "fc2 dgrad: [%lld x %lld] x [%lld x %lld])\n",
              dtype_str(t), (long long)b, (long long)d, (long long)h, (long long)b, (long long)d, (long long)(2 * h),
              (long long)d, (long long)b, (long long)d, (long long)d, (long long)h);
  // The correctness of the timed kernels at this size, on a sample of rows (the last included).
  const std::vector<int64_t> rows = {0, 1, 127, 128, b / 2 + 1, b - 2, b - 1};
  const ForwardProblem fp = make_forward(b, d, h, t, rng, rows);
  const DgradProblem dp = make_dgrad(b, h, d, t, rng, rows);
  test_forward(fp, ws);
  test_dgrad(dp, ws);

  Dev x(b * d), w(2 * h * d), out(b * h), gu(b * 2 * h), big(b * 2 * h);
  x.upload(fp.x.bits);
  w.upload(fp.w.bits);
  const double fwd_flop = 2.0 * b * 2 * h * d;
  LtGemm lt_fwd(t, true, 2 * h, b, d, ws.bytes);
  const double base_fwd = time_baseline("forward  cuBLASLt GEMM [B, 2h]", lt_fwd, w.p, x.p, big.p, ws, fwd_flop);
  // the unfused path's gating pass reads gu and writes out: B (2h + h) 16-bit values
  Dev copy_from(b * 3 * h), copy_to(b * 3 * h);  // 6 B h bytes each
  time_traffic("forward  gating pass's traffic", b * 3 * h, copy_from, copy_to, base_fwd);
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU}) {
    CutlassSm90GatedForwardArgs a = forward_args(b, d, h, t, act, x.p, w.p, out.p, gu.p);
    for (int v = 0; v < cutlass_sm90_gated_forward_variants(a); ++v)
      for (bool store_gu : {true, false}) {
        a.gu = store_gu ? gu.p : nullptr;
        print_timing("forward", act, v, store_gu ? "+gu" : "",
                     time_ms([&] { cutlass_sm90_gated_forward(v, a, ws, 0); }), fwd_flop, base_fwd);
      }
  }

  Dev d_out(b * d), w2(d * h), gu_in(b * 2 * h), d_gu(b * 2 * h), h_out(b * h);
  d_out.upload(dp.d_out.bits);
  w2.upload(dp.w2.bits);
  gu_in.upload(dp.gu.bits);
  const double bwd_flop = 2.0 * b * h * d;
  LtGemm lt_bwd(t, false, h, b, d, ws.bytes);
  const double base_bwd = time_baseline("dgrad    cuBLASLt GEMM [B, h]", lt_bwd, w2.p, d_out.p, big.p, ws, bwd_flop);
  // the unfused path's gating backward reads d_h and gu and writes d_gu (and h): B (h + 2h + 2h (+ h))
  time_traffic("dgrad    gating backward's traffic", b * 5 * h, copy_from, copy_to, base_bwd);
  time_traffic("dgrad    the same, with h", b * 6 * h, copy_from, copy_to, base_bwd);
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU}) {
    CutlassSm90GatedDgradArgs a = dgrad_args(b, h, d, t, act, d_out.p, w2.p, gu_in.p, d_gu.p);
    for (int v = 0; v < cutlass_sm90_gated_dgrad_variants(a); ++v)
      for (bool with_h : {false, true}) {
        a.act_out = with_h ? h_out.p : nullptr;
        print_timing("dgrad", act, v, with_h ? "+h" : "", time_ms([&] { cutlass_sm90_gated_dgrad(v, a, ws, 0); }),
                     bwd_flop, base_bwd);
      }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool run_bench = true;
  std::vector<DType> dtypes = {DType::kBFloat16, DType::kFloat16};
  std::vector<BenchShape> bench_shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    long long sb = 0, sd = 0, sh = 0;
    if (arg == "--shape" && i + 1 < argc && std::sscanf(argv[i + 1], "%lld,%lld,%lld", &sb, &sd, &sh) == 3 &&
        sb >= 256 && sd > 0 && sd % 8 == 0 && sh > 0 && sh % kGatedInterleave == 0) {
      bench_shapes.push_back({sb, sd, sh});
      ++i;
    } else if (arg == "--shape") {
      std::fprintf(stderr, "--shape takes B,d,h: B >= 256, d a multiple of 8, h of %lld\n",
                   static_cast<long long>(kGatedInterleave));
      return 2;
    } else if (arg == "--bench-only") {
      g_bench_only = true;
    } else if (arg == "--bf16-only") {
      dtypes = {DType::kBFloat16};
    } else if (arg == "--no-bench") {
      run_bench = false;
    } else if (arg == "--sanitize") {
      g_exact_alloc = true;
      run_bench = false;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  CK(cudaGetDevice(&g_device));
  const DeviceInfo& info = device_info(g_device);
  std::printf("device %d: %s, cc %d.%d, %d SMs\n", g_device, info.name().c_str(), info.cc_major(), info.cc_minor(),
              info.sm_count());
  Workspace ws;
  ws.bytes = 32u << 20;
  CK(cudaMalloc(&ws.ptr, ws.bytes));
  {
    const CutlassSm90GatedForwardArgs probe =
        forward_args(64, 64, 64, DType::kBFloat16, Activation::kSwiGLU, ws.ptr, ws.ptr, ws.ptr, nullptr);
    if (cutlass_sm90_gated_forward_variants(probe) == 0) {
      std::printf("SKIP: the cutlass_sm90 gated kernels are not compiled in or the device is not cc 9.0\n");
      return 77;
    }
  }
  const uint64_t seed = static_cast<uint64_t>(std::time(nullptr));
  std::printf("random inputs from seed %llu\n", static_cast<unsigned long long>(seed));
  Rng rng(seed);

  if (!g_bench_only) test_refusals(ws);

  // (B, d, h) forward and (B, h, N) data gradient. Edge tiles: B not a multiple of 128; h a
  // multiple of 8 but not of 64 (2h, h not multiples of the 128 / 256 tile widths); K not a
  // multiple of the 64-deep k-block.
  struct Shape {
    int64_t b, d, h;
  };
  std::vector<Shape> shapes = {{1, 8, 8}, {200, 136, 72}, {130, 72, 264}};
  if (!g_exact_alloc) {
    shapes.push_back({128, 64, 64});
    shapes.push_back({333, 256, 136});
    shapes.push_back({520, 1000, 1352});
    shapes.push_back({1030, 512, 1000});
    shapes.push_back({256, 2048, 1024});
  }
  if (g_bench_only) shapes.clear();
  for (DType t : dtypes) {
    for (const Shape& s : shapes) {
      test_forward(make_forward(s.b, s.d, s.h, t, rng, all_rows(s.b)), ws);
      test_dgrad(make_dgrad(s.b, s.h, s.d, t, rng, all_rows(s.b)), ws);
    }
  }
  std::printf("correctness: %d passed, %d failed\n", g_passed, g_failed);

  if (run_bench) {
    if (bench_shapes.empty()) bench_shapes.push_back({8192, 4096, 11008});
    for (DType t : dtypes)
      for (const BenchShape& s : bench_shapes) bench(t, s, ws, rng);
    std::printf("with the checks at the timed shapes: %d passed, %d failed\n", g_passed, g_failed);
  }
  cudaFree(ws.ptr);
  return g_failed == 0 ? 0 : 1;
}
