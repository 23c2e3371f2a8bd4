// Standalone check of the elementwise kernels (csrc/core/elementwise/elementwise.h) against a host fp64
// reference (no PyTorch).
//
// Build (from the repository root; extra arguments go to nvcc, e.g. -lineinfo for the sanitizers):
//   bash tests/native/build.sh build/test_elementwise
// Run:  build/test_elementwise            correctness suite, prints "N passed, M failed (full mode)"
//       build/test_elementwise --quick    skip the large shapes
//       build/test_elementwise --sanitize a few hundred small cases that still reach every kernel
//                                         path, for compute-sanitizer (build with -lineinfo); see
//                                         run_sanitize_cases
//       build/test_elementwise --bench    also time large shapes and print effective GB/s
//       build/test_elementwise --bench-only
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/elementwise/elementwise.h"
#include "core/common/types.h"

using namespace fused_dense::core;

namespace {

#define CK(expr)                                                                                \
  do {                                                                                          \
    cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s (case %s)\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   #expr, g_current.c_str());                                                   \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

// Name of the case in flight, for fatal CUDA errors (they poison the context, so we stop).
std::string g_current;
int g_passed = 0;
int g_failed = 0;
// --sanitize: device buffers are allocated with their exact size (view offset included) instead
// of 64 bytes of slack, so that compute-sanitizer memcheck sees any access past the end.
bool g_exact_alloc = false;
// The device every case runs on (the current device at start; the library is told it explicitly).
int g_device = 0;

void record(bool ok, const std::string& name, const std::string& detail = "") {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    if (g_failed <= 60) std::printf("FAIL %s %s\n", name.c_str(), detail.c_str());
  }
}

// ----------------------------------------------------------------------------------------------
// Host-side dtype handling.

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>((next() >> 40) * (1.0 / (1ull << 24))); }
};

size_t esize(DType d) { return dtype_size(d); }

float get(DType d, const std::vector<uint8_t>& buf, size_t i) {
  switch (d) {
    case DType::kFloat16: {
      __half h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return __half2float(h);
    }
    case DType::kBFloat16: {
      __nv_bfloat16 h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return __bfloat162float(h);
    }
    default: {
      float f;
      std::memcpy(&f, buf.data() + 4 * i, 4);
      return f;
    }
  }
}

void put(DType d, std::vector<uint8_t>& buf, size_t i, float v) {
  switch (d) {
    case DType::kFloat16: {
      __half h = __float2half_rn(v);
      std::memcpy(buf.data() + 2 * i, &h, 2);
      break;
    }
    case DType::kBFloat16: {
      __nv_bfloat16 h = __float2bfloat16_rn(v);
      std::memcpy(buf.data() + 2 * i, &h, 2);
      break;
    }
    default:
      std::memcpy(buf.data() + 4 * i, &v, 4);
  }
}

float round_to(DType d, float v) {
  std::vector<uint8_t> b(4);
  put(d, b, 0, v);
  return get(d, b, 0);
}

double rtol_of(DType d) {
  switch (d) {
    case DType::kFloat16:
      return 2e-3;
    case DType::kBFloat16:
      return 1.6e-2;
    default:
      return 2e-5;
  }
}

double atol_of(DType d) {
  switch (d) {
    case DType::kFloat16:
      return 2e-5;
    case DType::kBFloat16:
      return 2e-4;
    default:
      return 2e-6;
  }
}

bool close(double got, double ref, double rtol, double atol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isnan(got)) return false;
  if (std::isinf(ref)) return got == ref;
  return std::fabs(got - ref) <= rtol * std::fabs(ref) + atol;
}

// ----------------------------------------------------------------------------------------------
// fp64 reference activations.

const double kK0 = 0.7978845608028654;
const double kK1 = 0.044715;

double ref_act(Activation a, double p) {
  switch (a) {
    case Activation::kNone:
      return p;
    case Activation::kGeluTanh:
      return 0.5 * p * (1.0 + std::tanh(kK0 * (p + kK1 * p * p * p)));
    case Activation::kRelu:
      return p > 0 ? p : 0.0;
    case Activation::kSquaredRelu:
      return p > 0 ? p * p : 0.0;
  }
  return 0;
}

double ref_dact(Activation a, double p) {
  switch (a) {
    case Activation::kNone:
      return 1.0;
    case Activation::kGeluTanh: {
      // The limits (the expression below takes inf * 0 at p = +-inf); 1 and 0 in double already
      // from |p| = 20 on. A NaN p falls through and stays NaN.
      if (std::fabs(p) > 20.0) return p > 0 ? 1.0 : 0.0;
      const double t = std::tanh(kK0 * (p + kK1 * p * p * p));
      return 0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * kK0 * (1.0 + 3.0 * kK1 * p * p);
    }
    case Activation::kRelu:
      return p > 0 ? 1.0 : 0.0;
    case Activation::kSquaredRelu:
      return p > 0 ? 2.0 * p : 0.0;
  }
  return 0;
}

// ----------------------------------------------------------------------------------------------
// Device buffers: one allocation with slack so a view can be deliberately misaligned.

struct DevBuf {
  uint8_t* base = nullptr;
  uint8_t* ptr = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(size_t n, size_t offset) : bytes(n) {
    CK(cudaMalloc(&base, g_exact_alloc ? std::max<size_t>(n + offset, 1) : n + 64));
    ptr = base + offset;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (base) CK(cudaFree(base));
  }
  void upload(const std::vector<uint8_t>& h) {
    if (bytes) CK(cudaMemcpy(ptr, h.data(), bytes, cudaMemcpyHostToDevice));
  }
  void poison() {
    if (bytes) CK(cudaMemset(ptr, 0xFF, bytes));  // NaN in every float format, all mask bits set
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> h(bytes);
    if (bytes) CK(cudaMemcpy(h.data(), ptr, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

const char* aname(Activation a) { return activation_name(a); }

std::string case_name(const char* what, DType d, Activation a, int64_t rows, int64_t cols, const std::string& extra) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s[%s,%s,rows=%lld,cols=%lld%s]", what, dtype_name(d), aname(a),
                static_cast<long long>(rows), static_cast<long long>(cols), extra.c_str());
  return buf;
}

// ----------------------------------------------------------------------------------------------
// Forward.

enum class Alias { kNone, kXisOut, kXisPre };

void test_forward(DType d, Activation a, int64_t rows, int64_t cols, bool use_bias, bool use_pre, Alias alias,
                  bool misalign, uint64_t seed) {
  const bool mask_mode = a == Activation::kRelu && use_pre;
  if (alias == Alias::kXisPre && (!use_pre || mask_mode)) return;
  std::string extra = std::string(use_bias ? ",bias" : "") + (use_pre ? ",pre" : "") +
                      (alias == Alias::kXisOut ? ",x=out" : alias == Alias::kXisPre ? ",x=pre" : "") +
                      (misalign ? ",misaligned" : "");
  const std::string name = case_name("forward", d, a, rows, cols, extra);
  g_current = name;

  const size_t es = esize(d);
  const size_t n = static_cast<size_t>(rows) * cols;
  const int64_t rb = relu_mask_row_bytes(cols);
  const size_t pre_bytes = mask_mode ? static_cast<size_t>(rows) * rb : n * es;
  Rng rng(seed);

  std::vector<uint8_t> hx(n * es), hb(cols * es);
  for (int64_t j = 0; j < cols; ++j) put(d, hb, j, use_bias ? rng.uniform(-1.f, 1.f) : 0.f);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng.next();
    float v = rng.uniform(-3.f, 3.f);
    // Exact zeros of x + bias exercise the ">= 0" of the ReLU mask (cuBLASLt's convention).
    if ((r & 15) == 0) v = use_bias ? -get(d, hb, i % cols) : 0.f;
    put(d, hx, i, v);
  }

  const size_t off = misalign ? es : 0;
  DevBuf dx(n * es, off), dbias(use_bias ? cols * es : 0, off), dout(n * es, off),
      dpre(use_pre ? pre_bytes : 0, misalign ? (mask_mode ? 1 : es) : 0);
  dout.poison();
  dpre.poison();
  void* xptr = dx.ptr;
  if (alias == Alias::kXisOut) {
    dout.upload(hx);
    xptr = dout.ptr;
  } else if (alias == Alias::kXisPre) {
    dpre.upload(hx);
    xptr = dpre.ptr;
  } else {
    dx.upload(hx);
  }
  dbias.upload(hb);

  try {
    bias_act_forward(d, a, xptr, use_bias ? dbias.ptr : nullptr, dout.ptr, use_pre ? dpre.ptr : nullptr, rows, cols,
                     g_device, nullptr);
    CK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    record(false, name, std::string("threw: ") + e.what());
    return;
  }

  const auto hout = dout.download();
  const auto hpre = dpre.download();
  const double rtol = rtol_of(d), atol = atol_of(d);
  bool ok = true;
  std::string detail;
  for (int64_t i = 0; i < rows && ok; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const size_t k = static_cast<size_t>(i) * cols + j;
      // Same fp32 add and rounding as the device, so pre_act and the mask must match exactly.
      const float p32 = get(d, hx, k) + (use_bias ? get(d, hb, j) : 0.f);
      const float pr = round_to(d, p32);
      const double ref = ref_act(a, pr);
      const double got = get(d, hout, k);
      if (!close(got, ref, rtol, atol)) {
        ok = false;
        detail = "out[" + std::to_string(i) + "," + std::to_string(j) + "]=" + std::to_string(got) +
                 " ref=" + std::to_string(ref);
        break;
      }
      if (use_pre && !mask_mode) {
        std::vector<uint8_t> want(es);
        put(d, want, 0, pr);
        if (std::memcmp(want.data(), hpre.data() + k * es, es) != 0) {
          ok = false;
          detail = "pre_act[" + std::to_string(i) + "," + std::to_string(j) + "] differs";
          break;
        }
      }
    }
    if (ok && mask_mode) {
      for (int64_t b = 0; b < rb; ++b) {
        unsigned want = 0;
        for (int bit = 0; bit < 8; ++bit) {
          const int64_t j = b * 8 + bit;
          if (j >= cols) break;
          const size_t k = static_cast<size_t>(i) * cols + j;
          const float p32 = get(d, hx, k) + (use_bias ? get(d, hb, j) : 0.f);
          if (round_to(d, p32) >= 0.f) want |= 1u << bit;
        }
        const unsigned got = hpre[static_cast<size_t>(i) * rb + b];
        if (got != want) {
          ok = false;
          char buf[128];
          std::snprintf(buf, sizeof(buf), "mask[%lld,%lld]=0x%02x want 0x%02x", static_cast<long long>(i),
                        static_cast<long long>(b), got, want);
          detail = buf;
          break;
        }
      }
    }
  }
  record(ok, name, detail);
}

// ----------------------------------------------------------------------------------------------
// Backward.

enum class Ws { kPreferred, kMinimal, kHalf };

void test_backward(DType d, Activation a, int64_t rows, int64_t cols, bool use_bias_grad, bool inplace, bool misalign,
                   Ws ws_mode, uint64_t seed) {
  std::string extra = std::string(use_bias_grad ? ",bias_grad" : "") + (inplace ? ",grad_in=grad" : "") +
                      (misalign ? ",misaligned" : "") +
                      (!use_bias_grad ? ""
                       : ws_mode == Ws::kMinimal ? ",ws=min"
                       : ws_mode == Ws::kHalf    ? ",ws=half"
                                                 : "");
  const std::string name = case_name("backward", d, a, rows, cols, extra);
  g_current = name;

  const size_t es = esize(d);
  const size_t n = static_cast<size_t>(rows) * cols;
  const int64_t rb = relu_mask_row_bytes(cols);
  const bool mask_mode = a == Activation::kRelu;
  const size_t pre_bytes = mask_mode ? static_cast<size_t>(rows) * rb : n * es;
  Rng rng(seed);

  std::vector<uint8_t> hg(n * es), hp(pre_bytes);
  for (size_t i = 0; i < n; ++i) put(d, hg, i, rng.uniform(-2.f, 2.f));
  if (mask_mode) {
    // Random bytes, padding bits included: the kernels must ignore the padding.
    for (size_t i = 0; i < pre_bytes; ++i) hp[i] = static_cast<uint8_t>(rng.next() >> 32);
  } else {
    // GELU: one pre-activation in 64 from the far ends, where the derivative's factors saturate
    // (e = exp(-2u) overflows, p * u' overflows) and only the limit 0 or 1 is right; NaN must come
    // through as NaN (not where a bias gradient sums the column: one NaN would hide the rest).
    const float kFar[] = {12.f, -12.f, 1e4f, -1e4f, 1e30f, -1e30f, INFINITY, -INFINITY, NAN};
    const uint64_t far_count = a != Activation::kGeluTanh ? 0 : use_bias_grad ? 8 : 9;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t r = rng.next();
      put(d, hp, i,
          (r & 15) == 0   ? 0.f
          : (r & 63) == 1 && far_count > 0 ? kFar[(r >> 8) % far_count]
                          : rng.uniform(-4.f, 4.f));
    }
  }

  const size_t off = misalign ? es : 0;
  DevBuf dg(n * es, off), dp(pre_bytes, misalign ? (mask_mode ? 1 : es) : 0), dgi(inplace ? 0 : n * es, off),
      dbg(use_bias_grad ? cols * es : 0, off);
  dg.upload(hg);
  dp.upload(hp);
  dgi.poison();
  dbg.poison();
  void* gi_ptr = inplace ? dg.ptr : dgi.ptr;

  size_t ws_bytes = 0;
  if (use_bias_grad) {
    const size_t pref = reduction_workspace_bytes(rows, cols);
    const size_t minimal = static_cast<size_t>(cols) * sizeof(float);
    ws_bytes = ws_mode == Ws::kPreferred ? pref : ws_mode == Ws::kMinimal ? minimal : std::max(minimal, pref / 2);
    if (rows > 0 && pref < minimal) {
      record(false, name, "reduction_workspace_bytes below cols*4");
      return;
    }
  }
  DevBuf dws(std::max<size_t>(ws_bytes, 4), 0);
  dws.poison();

  std::vector<uint8_t> first_bg;
  for (int rep = 0; rep < 2; ++rep) {
    if (rep == 1) {
      // Second run on the same inputs must reproduce the bias gradient bit for bit.
      if (!use_bias_grad || inplace) break;
      dbg.poison();
      dws.poison();
    }
    try {
      act_backward_bias_grad(d, a, dg.ptr, a == Activation::kNone ? nullptr : dp.ptr, gi_ptr,
                             use_bias_grad ? dbg.ptr : nullptr, rows, cols, use_bias_grad ? dws.ptr : nullptr,
                             ws_bytes, g_device, nullptr);
      CK(cudaDeviceSynchronize());
    } catch (const std::exception& e) {
      record(false, name, std::string("threw: ") + e.what());
      return;
    }
    if (rep == 1) {
      record(dbg.download() == first_bg, name + "/deterministic");
      return;
    }
    first_bg = dbg.download();

    const auto hgi = inplace ? dg.download() : dgi.download();
    const double rtol = rtol_of(d), atol = atol_of(d);
    bool ok = true;
    std::string detail;
    for (int64_t i = 0; i < rows && ok; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = static_cast<size_t>(i) * cols + j;
        const double g = get(d, hg, k);
        double ref;
        if (mask_mode) {
          ref = ((hp[static_cast<size_t>(i) * rb + j / 8] >> (j % 8)) & 1) ? g : 0.0;
        } else {
          ref = g * ref_dact(a, a == Activation::kNone ? 0.0 : get(d, hp, k));
        }
        const double got = get(d, hgi, k);
        const bool exact = a == Activation::kNone || a == Activation::kRelu;
        if (exact ? got != ref : !close(got, ref, rtol, atol)) {
          ok = false;
          detail = "grad_in[" + std::to_string(i) + "," + std::to_string(j) + "]=" + std::to_string(got) +
                   " ref=" + std::to_string(ref);
          break;
        }
      }
    }
    if (ok && use_bias_grad) {
      const auto hbg = first_bg;
      for (int64_t j = 0; j < cols; ++j) {
        // The bias gradient sums the rounded grad_in that was actually written.
        double ref = 0, mag = 0;
        for (int64_t i = 0; i < rows; ++i) {
          const double v = get(d, hgi, static_cast<size_t>(i) * cols + j);
          ref += v;
          mag += std::fabs(v);
        }
        const double got = get(d, hbg, j);
        if (!close(got, ref, rtol_of(d), atol_of(d) + 2e-6 * mag)) {
          ok = false;
          detail = "bias_grad[" + std::to_string(j) + "]=" + std::to_string(got) + " ref=" + std::to_string(ref);
          break;
        }
      }
    }
    record(ok, name, detail);
  }
}

// The backward's act_out (checkpoint level 1 rebuilds act(pre) in the pass that reads pre): must
// equal bias_act_forward's output for the same pre bit for bit, as act_forward's must, and leave
// grad_in and the bias gradient bit-identical to a call without it.
void test_backward_act_out(DType d, Activation a, int64_t rows, int64_t cols, bool use_bias_grad, bool misalign,
                           uint64_t seed) {
  const std::string name = case_name("backward_act_out", d, a, rows, cols,
                                     std::string(use_bias_grad ? ",bias_grad" : "") + (misalign ? ",misaligned" : ""));
  g_current = name;
  const size_t es = esize(d);
  const size_t n = static_cast<size_t>(rows) * cols;
  Rng rng(seed);
  std::vector<uint8_t> hg(n * es), hp(n * es);
  for (size_t i = 0; i < n; ++i) put(d, hg, i, rng.uniform(-2.f, 2.f));
  for (size_t i = 0; i < n; ++i) put(d, hp, i, rng.uniform(-4.f, 4.f));
  const size_t off = misalign ? es : 0;
  DevBuf dg(n * es, off), dp(n * es, off), fwd(n * es, off), op(n * es, off), gi_ref(n * es, off), gi(n * es, off),
      ao(n * es, off), bg_ref(use_bias_grad ? cols * es : 0, off), bg(use_bias_grad ? cols * es : 0, off);
  dg.upload(hg);
  dp.upload(hp);
  for (DevBuf* b : {&fwd, &op, &gi_ref, &gi, &ao, &bg_ref, &bg}) b->poison();
  const size_t ws_bytes = use_bias_grad ? reduction_workspace_bytes(rows, cols) : 0;
  DevBuf ws(std::max<size_t>(ws_bytes, 4), 0);
  try {
    bias_act_forward(d, a, dp.ptr, nullptr, fwd.ptr, nullptr, rows, cols, g_device, nullptr);
    act_forward(d, a, dp.ptr, op.ptr, rows, cols, g_device, nullptr);
    act_backward_bias_grad(d, a, dg.ptr, dp.ptr, gi_ref.ptr, use_bias_grad ? bg_ref.ptr : nullptr, rows, cols,
                           use_bias_grad ? ws.ptr : nullptr, ws_bytes, g_device, nullptr);
    act_backward_bias_grad(d, a, dg.ptr, dp.ptr, gi.ptr, use_bias_grad ? bg.ptr : nullptr, rows, cols,
                           use_bias_grad ? ws.ptr : nullptr, ws_bytes, g_device, nullptr, ao.ptr);
    CK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    record(false, name, std::string("threw: ") + e.what());
    return;
  }
  std::string detail;
  if (ao.download() != fwd.download()) detail = "act_out differs from bias_act_forward's output";
  else if (op.download() != fwd.download()) detail = "act_forward differs from bias_act_forward's output";
  else if (gi.download() != gi_ref.download()) detail = "grad_in differs from the call without act_out";
  else if (use_bias_grad && bg.download() != bg_ref.download())
    detail = "bias_grad differs from the call without act_out";
  record(detail.empty(), name, detail);
}

// ----------------------------------------------------------------------------------------------
// The gating kernels (gated_act_forward / gated_act_backward) over the packed layout, whose columns
// are written out here from the documented rule (blocks of kGatedInterleave units: the block's gate
// columns, then its up columns; the last block may be short), not taken from types.h's helpers.

void gated_columns_ref(int64_t hidden, std::vector<int64_t>& gate, std::vector<int64_t>& up) {
  gate.clear();
  up.clear();
  for (int64_t start = 0; start < hidden; start += kGatedInterleave) {
    const int64_t width = std::min<int64_t>(kGatedInterleave, hidden - start);
    for (int64_t o = 0; o < width; ++o) gate.push_back(2 * start + o);
    for (int64_t o = 0; o < width; ++o) up.push_back(2 * start + width + o);
  }
}

double ref_gate(Activation a, double g, double* deriv) {
  if (a == Activation::kGeGLU) {
    *deriv = ref_dact(Activation::kGeluTanh, g);
    return ref_act(Activation::kGeluTanh, g);
  }
  const double s = 1.0 / (1.0 + std::exp(-g));
  *deriv = s * (1.0 + g * (1.0 - s));
  return g * s;
}

// out = act(g) * u; (d_g, d_u) from d_out, in place over gu when `inplace`; the backward's rebuilt
// out must be the forward's bits.
void test_gated(DType d, Activation a, int64_t rows, int64_t hidden, bool misalign, bool inplace, uint64_t seed) {
  const std::string name = case_name("gated", d, a, rows, hidden,
                                     std::string(misalign ? ",misaligned" : "") + (inplace ? ",inplace" : ""));
  g_current = name;
  const size_t es = esize(d);
  const size_t n = static_cast<size_t>(rows) * hidden;
  Rng rng(seed);
  std::vector<uint8_t> hgu(2 * n * es), hd(n * es);
  for (size_t i = 0; i < 2 * n; ++i) put(d, hgu, i, rng.uniform(-4.f, 4.f));
  for (size_t i = 0; i < n; ++i) put(d, hd, i, rng.uniform(-2.f, 2.f));
  const size_t off = misalign ? es : 0;
  DevBuf gu(2 * n * es, off), dout(n * es, off), out(n * es, off), out2(n * es, off), dgu(2 * n * es, off);
  gu.upload(hgu);
  dout.upload(hd);
  for (DevBuf* b : {&out, &out2, &dgu}) b->poison();
  try {
    gated_act_forward(d, a, gu.ptr, out.ptr, rows, hidden, g_device, nullptr);
    CK(cudaDeviceSynchronize());
    const std::vector<uint8_t> fwd = out.download();
    gated_act_backward(d, a, dout.ptr, gu.ptr, inplace ? gu.ptr : dgu.ptr, out2.ptr, rows, hidden, g_device,
                       nullptr);
    CK(cudaDeviceSynchronize());
    const std::vector<uint8_t> rebuilt = out2.download(), grads = (inplace ? gu : dgu).download();
    std::vector<int64_t> gc, uc;
    gated_columns_ref(hidden, gc, uc);
    std::string detail;
    if (rebuilt != fwd) detail = "the backward's act(g) * u differs from the forward's";
    const double rtol = 2 * rtol_of(d), atol = 4 * atol_of(d);
    for (int64_t r = 0; r < rows && detail.empty(); ++r)
      for (int64_t j = 0; j < hidden && detail.empty(); ++j) {
        const size_t row = static_cast<size_t>(r) * 2 * hidden;
        const double g = get(d, hgu, row + gc[j]), u = get(d, hgu, row + uc[j]);
        const double dd = get(d, hd, static_cast<size_t>(r) * hidden + j);
        double slope;
        const double act = ref_gate(a, g, &slope);
        const double h = get(d, fwd, static_cast<size_t>(r) * hidden + j);
        const double dg = get(d, grads, row + gc[j]), du = get(d, grads, row + uc[j]);
        char buf[200];
        if (!close(h, act * u, rtol, atol) || !close(dg, dd * u * slope, rtol, atol) ||
            !close(du, dd * act, rtol, atol)) {
          std::snprintf(buf, sizeof(buf), "row %lld unit %lld: h %g (ref %g), d_g %g (ref %g), d_u %g (ref %g)",
                        static_cast<long long>(r), static_cast<long long>(j), h, act * u, dg, dd * u * slope, du,
                        dd * act);
          detail = buf;
        }
      }
    record(detail.empty(), name, detail);
  } catch (const std::exception& e) {
    record(false, name, std::string("threw: ") + e.what());
  }
}

// ----------------------------------------------------------------------------------------------
// sum_partials: out[j] = sum over p of partial[p * stride + j] (the cutlass_sm90 data gradient's
// bias gradient).
// The padding columns [cols, stride) hold 1e30 so that reading them shows; out has one poisoned
// element past cols that must stay poisoned.

void test_sum_partials(DType d, int64_t nparts, int64_t stride, int64_t cols, uint64_t seed) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "sum_partials[%s,nparts=%lld,stride=%lld,cols=%lld]", dtype_name(d),
                static_cast<long long>(nparts), static_cast<long long>(stride), static_cast<long long>(cols));
  const std::string name = buf;
  g_current = name;
  Rng rng(seed);
  const size_t n = static_cast<size_t>(nparts) * static_cast<size_t>(stride);
  std::vector<float> hp(n);
  for (size_t i = 0; i < n; ++i) hp[i] = (static_cast<int64_t>(i % stride) < cols) ? rng.uniform(-1.f, 1.f) : 1e30f;
  std::vector<uint8_t> hp_bytes(n * sizeof(float));
  if (n) std::memcpy(hp_bytes.data(), hp.data(), hp_bytes.size());
  const size_t es = esize(d);
  DevBuf dp(hp_bytes.size(), 0), out((cols + 1) * es, 0), out2((cols + 1) * es, 0);
  dp.upload(hp_bytes);
  out.poison();
  out2.poison();
  sum_partials(d, reinterpret_cast<const float*>(dp.ptr), stride, nparts, cols, out.ptr, nullptr);
  sum_partials(d, reinterpret_cast<const float*>(dp.ptr), stride, nparts, cols, out2.ptr, nullptr);
  CK(cudaDeviceSynchronize());
  const auto got = out.download(), again = out2.download();
  // the output's rounding, plus fp32 summation error over nparts terms
  const double tol = (d == DType::kFloat32 ? 0.0 : d == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8));
  std::string detail;
  for (int64_t j = 0; j < cols && detail.empty(); ++j) {
    double ref = 0, mag = 0;
    for (int64_t p = 0; p < nparts; ++p) {
      ref += hp[p * stride + j];
      mag += std::fabs(hp[p * stride + j]);
    }
    const double v = get(d, got, j);
    if (!(std::fabs(v - ref) <= tol * std::fabs(ref) + 1e-5 * (mag + 1.0)))
      detail = "out[" + std::to_string(j) + "]=" + std::to_string(v) + " ref=" + std::to_string(ref);
  }
  for (size_t b = static_cast<size_t>(cols) * es; b < got.size() && detail.empty(); ++b)
    if (got[b] != 0xFF) detail = "wrote past cols";
  if (detail.empty() && got != again) detail = "two runs differ";
  record(detail.empty(), name, detail);
}

// ----------------------------------------------------------------------------------------------
// Error paths.

void expect_throw(const std::string& name, const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    record(true, name);
    return;
  } catch (const std::exception& e) {
    record(false, name, std::string("threw a non-core exception: ") + e.what());
    return;
  }
  record(false, name, "did not throw");
}

void test_errors() {
  DevBuf a(4096, 0), b(4096, 0), c(4096, 0);
  expect_throw("error/gated code to the non-gated forward", [&] {
    bias_act_forward(DType::kFloat16, Activation::kSwiGLU, a.ptr, nullptr, b.ptr, nullptr, 4, 8, g_device, nullptr);
  });
  expect_throw("error/non-gated code to the gating forward", [&] {
    gated_act_forward(DType::kFloat16, Activation::kGeluTanh, a.ptr, b.ptr, 4, 8, g_device, nullptr);
  });
  expect_throw("error/gating backward: d_out overlapping gu", [&] {
    gated_act_backward(DType::kFloat16, Activation::kGeGLU, a.ptr + 16, a.ptr, c.ptr, nullptr, 4, 8, g_device,
                       nullptr);
  });
  expect_throw("error/negative rows fwd", [&] {
    bias_act_forward(DType::kFloat16, Activation::kGeluTanh, a.ptr, nullptr, b.ptr, nullptr, -1, 8, g_device, nullptr);
  });
  expect_throw("error/negative cols bwd", [&] {
    act_backward_bias_grad(DType::kFloat16, Activation::kGeluTanh, a.ptr, b.ptr, c.ptr, nullptr, 4, -8, nullptr, 0,
                           g_device, nullptr);
  });
  expect_throw("error/negative rows ws", [&] { reduction_workspace_bytes(-3, 8); });
  expect_throw("error/bad activation", [&] {
    bias_act_forward(DType::kFloat16, static_cast<Activation>(7), a.ptr, nullptr, b.ptr, nullptr, 4, 8, g_device,
                     nullptr);
  });
  expect_throw("error/bad dtype", [&] {
    bias_act_forward(static_cast<DType>(9), Activation::kRelu, a.ptr, nullptr, b.ptr, nullptr, 4, 8, g_device, nullptr);
  });
  expect_throw("error/workspace too small", [&] {
    act_backward_bias_grad(DType::kFloat32, Activation::kRelu, a.ptr, b.ptr, c.ptr, c.ptr + 2048, 4, 64, b.ptr + 1024,
                           64 * 4 - 4, g_device, nullptr);
  });
  expect_throw("error/null workspace", [&] {
    act_backward_bias_grad(DType::kFloat32, Activation::kGeluTanh, a.ptr, b.ptr, c.ptr, c.ptr + 2048, 4, 64, nullptr,
                           1 << 20, g_device, nullptr);
  });
  expect_throw("error/relu mask overlaps x", [&] {
    bias_act_forward(DType::kFloat16, Activation::kRelu, a.ptr, nullptr, b.ptr, a.ptr, 4, 64, g_device, nullptr);
  });
  expect_throw("error/partial overlap x,out", [&] {
    bias_act_forward(DType::kFloat16, Activation::kGeluTanh, a.ptr, nullptr, a.ptr + 2, nullptr, 4, 64, g_device,
                     nullptr);
  });
  expect_throw("error/null pre_act for gelu backward", [&] {
    act_backward_bias_grad(DType::kFloat16, Activation::kGeluTanh, a.ptr, nullptr, c.ptr, nullptr, 4, 64, nullptr, 0,
                           g_device, nullptr);
  });
  expect_throw("error/act_out with a relu mask", [&] {
    act_backward_bias_grad(DType::kFloat16, Activation::kRelu, a.ptr, b.ptr, c.ptr, nullptr, 4, 64, nullptr, 0,
                           g_device, nullptr, c.ptr + 1024);
  });
  expect_throw("error/act_out overlaps grad_in", [&] {
    act_backward_bias_grad(DType::kFloat16, Activation::kGeluTanh, a.ptr, b.ptr, c.ptr, nullptr, 4, 64, nullptr, 0,
                           g_device, nullptr, c.ptr + 64);
  });
  expect_throw("error/sum_partials stride < cols", [&] {
    sum_partials(DType::kFloat32, reinterpret_cast<const float*>(a.ptr), 63, 2, 64, b.ptr, nullptr);
  });
  expect_throw("error/sum_partials null out", [&] {
    sum_partials(DType::kFloat16, reinterpret_cast<const float*>(a.ptr), 64, 2, 64, nullptr, nullptr);
  });
  // Empty problems are legal no-ops.
  bool ok = true;
  try {
    bias_act_forward(DType::kFloat16, Activation::kRelu, nullptr, nullptr, nullptr, nullptr, 0, 5, g_device, nullptr);
    bias_act_forward(DType::kFloat16, Activation::kRelu, nullptr, nullptr, nullptr, nullptr, 5, 0, g_device, nullptr);
    act_backward_bias_grad(DType::kBFloat16, Activation::kGeluTanh, nullptr, nullptr, nullptr, nullptr, 7, 0, nullptr,
                           0, g_device, nullptr);
    ok = reduction_workspace_bytes(0, 100) == 0 && reduction_workspace_bytes(100, 0) == 0;
    CK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    ok = false;
  }
  record(ok, "empty problems are no-ops");
}

// ----------------------------------------------------------------------------------------------
// --sanitize: far fewer cases than --quick (which took more than 360 s under compute-sanitizer),
// chosen so that every elementwise kernel instantiation still runs (dtype x activation x
// vector/scalar path x ReLU mask or not, flat backward and column-sum backward, finalize), with
// and without bias / pre_act (mask) / bias_grad, in place and out of place, misaligned, at the
// edge widths, and with the multi-block grids. Every case is a test_forward / test_backward call,
// so it is checked against the host reference and its outputs are poisoned first.
//
// Forward variants (test_forward bias, pre, alias, misaligned):
//   P  bias, pre_act, out of place, aligned
//   N  no bias, no pre_act, out of place, aligned
//   O  bias, no pre_act, x = out (in place), aligned
//   A  bias, pre_act, in place: x = pre_act; ReLU (pre_act is the mask, which x may not alias): x = out
//   M  bias, pre_act, out of place, misaligned (every pointer one element, the mask one byte,
//      past 16-byte alignment: scalar paths)
//   m  no bias, pre_act, x = out, misaligned
// Backward variants (test_backward bias_grad, in place, misaligned, workspace):
//   G  bias_grad, out of place, aligned, preferred workspace (run twice: determinism)
//   g  no bias_grad, out of place, aligned
//   I  bias_grad, grad_in = grad, aligned, minimal workspace (one row chunk)
//   i  no bias_grad, grad_in = grad, aligned
//   H  bias_grad, out of place, misaligned, half the preferred workspace (run twice)
//   h  no bias_grad, out of place, misaligned
//
// Shapes (rows x cols). Vector widths: 8 elements for fp16/bf16, 4 for fp32; the ReLU mask
// kernels vectorize at cols % 8 == 0. Thresholds (flat_grid.cuh, bias_grad_reduction.cu,
// sum_partials.cu): a flat kernel takes ceil(items / 512) blocks; the bias gradient uses
// ceil(rows / 64) row chunks (kMinRowsPerChunk; the other cap, ceil(1056 / column tiles), binds
// only past 22528 rows at 600 columns), column tiles of at most 64 (scalar) or 256 (vector)
// columns, finalize blocks of 32 columns; the 4-rows-in-flight loop of the column sum runs when a
// chunk has more than 3 * (256 / tile threads) rows. So 257 and 300 rows already take the
// multi-chunk workspace path (5 chunks; 2 with half the workspace, 1 with the minimum) with
// several column tiles and finalize blocks: no larger case is needed.
//   0 x 13      no rows: forward is a no-op, bias_grad is set to 0
//   5 x 0       no columns: both are no-ops
//   3 x 1       width 1 (scalar, one mask bit per row)
//   7 x 13      prime width, not a multiple of any vector width, partial mask byte (5 bits)
//   9 x 12      fp32 vector path but 16-bit scalar path; ReLU mask scalar for every dtype
//               (partial byte: 4 bits); fp32 column-sum tile wider than the matrix
//   33 x 64     vector paths everywhere (mask vectorized), 2 blocks for fp32; warps partly past
//               the end in the fp32 mask kernel (528 vectors)
//   257 x 599   prime width, scalar paths, 301 blocks, 5 row chunks (last one shorter),
//               10 column tiles (last partial), 19 finalize blocks, partial mask byte (7 bits)
//   300 x 600   vector paths, 44-88 blocks, 5 / 2 / 1 row chunks (workspace preferred / half /
//               minimal), 3 column tiles (last partial), misaligned scalar column sum
// Per dtype x activation: 35 entry-point calls (13 forward, 22 backward, G and H counted twice),
// each recorded as one case: 420 in all; plus 24 act_out cases (dtype x {gelu, sqrelu} x 4, see
// run_sanitize_cases) and the 13 host-side cases of test_errors.
struct SanitizeShape {
  int64_t rows, cols;
  const char* fwd;
  const char* bwd;
};

constexpr SanitizeShape kSanitizeShapes[] = {
    {0, 13, "P", "G"},          {5, 0, "P", "I"},           {3, 1, "m", "H"},
    {7, 13, "NA", "gI"},        {9, 12, "OP", "Gh"},        {33, 64, "NMA", "Gih"},
    {257, 599, "P", "G"},       {300, 600, "PO", "GgIH"},
};

void run_sanitize_cases(uint64_t& seed) {
  const DType dtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  const Activation acts[] = {Activation::kNone, Activation::kGeluTanh, Activation::kRelu, Activation::kSquaredRelu};
  for (DType d : dtypes)
    for (Activation a : acts)
      for (const SanitizeShape& sh : kSanitizeShapes) {
        const int64_t r = sh.rows, c = sh.cols;
        for (const char* v = sh.fwd; *v; ++v) {
          const int before = g_passed + g_failed;
          switch (*v) {
            case 'P': test_forward(d, a, r, c, true, true, Alias::kNone, false, ++seed); break;
            case 'N': test_forward(d, a, r, c, false, false, Alias::kNone, false, ++seed); break;
            case 'O': test_forward(d, a, r, c, true, false, Alias::kXisOut, false, ++seed); break;
            case 'A':
              test_forward(d, a, r, c, true, true, a == Activation::kRelu ? Alias::kXisOut : Alias::kXisPre, false,
                           ++seed);
              break;
            case 'M': test_forward(d, a, r, c, true, true, Alias::kNone, true, ++seed); break;
            case 'm': test_forward(d, a, r, c, false, true, Alias::kXisOut, true, ++seed); break;
          }
          // A variant test_forward skips (records nothing) would be a case that cannot fail.
          if (g_passed + g_failed == before)
            record(false, case_name("sanitize/forward", d, a, r, c, std::string(",variant=") + *v), "ran no case");
        }
        for (const char* v = sh.bwd; *v; ++v) {
          const int before = g_passed + g_failed;
          switch (*v) {
            case 'G': test_backward(d, a, r, c, true, false, false, Ws::kPreferred, ++seed); break;
            case 'g': test_backward(d, a, r, c, false, false, false, Ws::kPreferred, ++seed); break;
            case 'I': test_backward(d, a, r, c, true, true, false, Ws::kMinimal, ++seed); break;
            case 'i': test_backward(d, a, r, c, false, true, false, Ws::kPreferred, ++seed); break;
            case 'H': test_backward(d, a, r, c, true, false, true, Ws::kHalf, ++seed); break;
            case 'h': test_backward(d, a, r, c, false, false, true, Ws::kPreferred, ++seed); break;
          }
          if (g_passed + g_failed == before)
            record(false, case_name("sanitize/backward", d, a, r, c, std::string(",variant=") + *v), "ran no case");
        }
      }
  // act_out: flat and column-sum kernels, vector and scalar paths, multi-chunk reduction.
  for (DType d : dtypes)
    for (Activation a : {Activation::kGeluTanh, Activation::kSquaredRelu}) {
      test_backward_act_out(d, a, 7, 13, false, false, ++seed);
      test_backward_act_out(d, a, 33, 64, true, true, ++seed);
      test_backward_act_out(d, a, 300, 600, true, false, ++seed);
      test_backward_act_out(d, a, 300, 600, false, false, ++seed);
    }
  // gating: vector path (hidden % 8 == 0, aligned), scalar path (short last block, misaligned), in place
  for (DType d : dtypes)
    for (Activation a : {Activation::kSwiGLU, Activation::kGeGLU}) {
      test_gated(d, a, 7, 13, false, false, ++seed);
      test_gated(d, a, 33, 64, false, true, ++seed);
      test_gated(d, a, 33, 64, true, false, ++seed);
      test_gated(d, a, 300, 600, false, false, ++seed);
    }
}

// ----------------------------------------------------------------------------------------------
// Timing.

void bench() {
  const int64_t rows = 16384, cols = 8192;
  const size_t n = static_cast<size_t>(rows) * cols;
  for (DType d : {DType::kBFloat16, DType::kFloat32}) {
    const size_t es = esize(d);
    DevBuf x(n * es, 0), out(n * es, 0), pre(n * es, 0), mask(n / 8, 0), bias(cols * es, 0), bg(cols * es, 0),
        ao(n * es, 0);
    CK(cudaMemset(x.ptr, 0x3c, n * es));
    CK(cudaMemset(bias.ptr, 0x3c, cols * es));
    CK(cudaMemset(pre.ptr, 0x3c, n * es));
    CK(cudaMemset(mask.ptr, 0x5a, n / 8));
    const size_t ws_bytes = reduction_workspace_bytes(rows, cols);
    DevBuf ws(ws_bytes, 0);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double copy_gbps = 0;  // the reference: a device-to-device copy of one matrix, bytes read + written
    auto timeit = [&](const char* label, double bytes, const std::function<void()>& f) {
      f();
      CK(cudaDeviceSynchronize());
      const int iters = 20;
      CK(cudaEventRecord(e0));
      for (int i = 0; i < iters; ++i) f();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      const double s = ms / 1e3 / iters;
      const double gbps = bytes / s / 1e9;
      if (copy_gbps == 0) copy_gbps = gbps;
      std::printf("bench %-9s %-48s %8.1f us  %7.0f GB/s  %5.1f%% of copy\n", dtype_name(d), label, s * 1e6, gbps,
                  100.0 * gbps / copy_gbps);
    };
    const double m = static_cast<double>(n) * es;
    timeit("copy: cudaMemcpyAsync device to device", 2 * m, [&] {
      CK(cudaMemcpyAsync(out.ptr, x.ptr, n * es, cudaMemcpyDeviceToDevice));
    });
    timeit("fwd gelu +bias +pre", 3 * m, [&] {
      bias_act_forward(d, Activation::kGeluTanh, x.ptr, bias.ptr, out.ptr, pre.ptr, rows, cols, g_device, nullptr);
    });
    timeit("fwd gelu +bias, in place", 2 * m, [&] {
      bias_act_forward(d, Activation::kGeluTanh, out.ptr, bias.ptr, out.ptr, nullptr, rows, cols, g_device, nullptr);
    });
    timeit("fwd gelu, in place (unfused path: bias in the GEMM)", 2 * m, [&] {
      bias_act_forward(d, Activation::kGeluTanh, out.ptr, nullptr, out.ptr, nullptr, rows, cols, g_device, nullptr);
    });
    timeit("fwd relu +bias +mask", 2 * m + n / 8.0, [&] {
      bias_act_forward(d, Activation::kRelu, x.ptr, bias.ptr, out.ptr, mask.ptr, rows, cols, g_device, nullptr);
    });
    timeit("fwd sqrelu +bias +pre", 3 * m, [&] {
      bias_act_forward(d, Activation::kSquaredRelu, x.ptr, bias.ptr, out.ptr, pre.ptr, rows, cols, g_device, nullptr);
    });
    timeit("bwd gelu", 3 * m, [&] {
      act_backward_bias_grad(d, Activation::kGeluTanh, x.ptr, pre.ptr, out.ptr, nullptr, rows, cols, nullptr, 0,
                             g_device, nullptr);
    });
    timeit("bwd gelu +bias_grad", 3 * m, [&] {
      act_backward_bias_grad(d, Activation::kGeluTanh, x.ptr, pre.ptr, out.ptr, bg.ptr, rows, cols, ws.ptr, ws_bytes,
                             g_device, nullptr);
    });
    timeit("bwd gelu +bias_grad +act_out (level-1 rebuild)", 4 * m, [&] {
      act_backward_bias_grad(d, Activation::kGeluTanh, x.ptr, pre.ptr, out.ptr, bg.ptr, rows, cols, ws.ptr, ws_bytes,
                             g_device, nullptr, ao.ptr);
    });
    timeit("bwd relu(mask) +bias_grad", 2 * m + n / 8.0, [&] {
      act_backward_bias_grad(d, Activation::kRelu, x.ptr, mask.ptr, out.ptr, bg.ptr, rows, cols, ws.ptr, ws_bytes,
                             g_device, nullptr);
    });
    timeit("bwd none +bias_grad (grad_in=grad)", m, [&] {
      act_backward_bias_grad(d, Activation::kNone, x.ptr, nullptr, x.ptr, bg.ptr, rows, cols, ws.ptr, ws_bytes,
                             g_device, nullptr);
    });
    timeit("bwd sqrelu +bias_grad, misaligned (scalar path)", 3 * m - 3 * es, [&] {
      act_backward_bias_grad(d, Activation::kSquaredRelu, x.ptr + es, pre.ptr + es, out.ptr + es, bg.ptr, rows,
                             cols - 1, ws.ptr, ws_bytes, g_device, nullptr);
    });
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, sanitize = false, do_bench = false, bench_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--sanitize")) sanitize = true;
    if (!std::strcmp(argv[i], "--bench")) do_bench = true;
    if (!std::strcmp(argv[i], "--bench-only")) do_bench = bench_only = true;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("no CUDA device\n");
    return 2;
  }
  CK(cudaGetDevice(&g_device));

  const DType dtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  const Activation acts[] = {Activation::kNone, Activation::kGeluTanh, Activation::kRelu, Activation::kSquaredRelu};
  const int64_t cols_list[] = {1, 7, 8, 9, 127, 128, 1000, 4096};
  const int64_t rows_list[] = {0, 1, 3, 257};

  if (bench_only) {
    bench();
    return 0;
  }

  uint64_t seed = 1;
  if (sanitize) {
    g_exact_alloc = true;
    run_sanitize_cases(seed);
  } else {
    for (DType d : dtypes)
      for (Activation a : acts)
        for (int64_t rows : rows_list)
          for (int64_t cols : cols_list) {
            for (int bias = 0; bias < 2; ++bias)
              for (int pre = 0; pre < 2; ++pre)
                for (Alias al : {Alias::kNone, Alias::kXisOut, Alias::kXisPre})
                  for (int mis = 0; mis < 2; ++mis) test_forward(d, a, rows, cols, bias, pre, al, mis, ++seed);
            for (int bg = 0; bg < 2; ++bg)
              for (int inplace = 0; inplace < 2; ++inplace)
                for (int mis = 0; mis < 2; ++mis)
                  for (Ws ws : {Ws::kPreferred, Ws::kMinimal, Ws::kHalf}) {
                    if (!bg && ws != Ws::kPreferred) continue;
                    test_backward(d, a, rows, cols, bg, inplace, mis, ws, ++seed);
                  }
            if (a == Activation::kGeluTanh || a == Activation::kSquaredRelu)
              for (int bg = 0; bg < 2; ++bg)
                for (int mis = 0; mis < 2; ++mis) test_backward_act_out(d, a, rows, cols, bg, mis, ++seed);
          }
    for (DType d : dtypes)
      for (Activation a : {Activation::kSwiGLU, Activation::kGeGLU})
        for (int64_t rows : rows_list)
          for (int64_t hidden : cols_list)
            for (int mis = 0; mis < 2; ++mis)
              for (int inplace = 0; inplace < 2; ++inplace) test_gated(d, a, rows, hidden, mis, inplace, ++seed);

    if (!quick) {
      // Large enough that every thread of the capped grids loops several times, so the
      // incremental (row, col) bookkeeping and the row-chunking are exercised.
      for (DType d : {DType::kFloat16, DType::kFloat32})
        for (Activation a : {Activation::kGeluTanh, Activation::kRelu})
          for (int mis = 0; mis < 2; ++mis) {
            test_forward(d, a, 40009, 1000, true, true, Alias::kNone, mis, ++seed);
            test_backward(d, a, 40009, 1000, true, false, mis, Ws::kPreferred, ++seed);
            test_backward(d, a, 40009, 1000, false, false, mis, Ws::kPreferred, ++seed);
          }
      test_forward(DType::kBFloat16, Activation::kSquaredRelu, 9001, 4104, true, true, Alias::kXisOut, false, ++seed);
      test_backward(DType::kBFloat16, Activation::kSquaredRelu, 9001, 4104, true, true, false, Ws::kHalf, ++seed);
    }
  }

  // The cutlass_sm90 data gradient's shapes (parts = row tiles of 128 over B, stride = K padded to
  // 128) and edges:
  // no parts (zeros), one column, a stride wider than cols, several column blocks of 32, more
  // column blocks than the grid (its column-block loop), parts not a multiple of the 8 part lanes.
  {
    const int64_t cases[][3] = {{0, 8, 5},     {1, 1, 1},        {1, 128, 1},  {3, 256, 136},
                                {64, 4096, 4096}, {8, 1024, 1000}, {67, 640, 600}, {2, 2097280, 2097153}};
    for (DType d : dtypes)
      for (const auto& c : cases)
        if (!sanitize || c[2] < 100000) test_sum_partials(d, c[0], c[1], c[2], ++seed);
  }

  test_errors();

  if (do_bench) bench();

  std::printf("%d passed, %d failed (%s mode)\n", g_passed, g_failed,
              sanitize ? "sanitize" : quick ? "quick" : "full");
  return g_failed == 0 ? 0 : 1;
}
