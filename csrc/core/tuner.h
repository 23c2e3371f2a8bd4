// Measured choice for heuristic = auto: on the first call of a problem, time each candidate
// (the fused epilogue with several of cuBLASLt's algorithms, plain GEMM + elementwise kernel
// with several plain algorithms, and where it applies each variant of the library's cutlass_sm90
// kernels, cutlass_sm90_dgrad.h and cutlass_sm90_forward.h) on the caller's stream and keep the
// fastest, process-wide.
// FUSED_DENSE_TUNING_CACHE=path persists choices across processes (one line per problem).
// FUSED_DENSE_TUNING=0 disables measuring (the fixed rule is used instead).
// FUSED_DENSE_TUNING_CANDIDATES=cutlass,fused,unfused (any subset, comma-separated) restricts the
// kinds of candidates measured; the tests use it to pin a path. cutlass:<c> in place of cutlass
// measures only the cutlass_sm90 variants of tile configuration c (the tests pin each
// configuration so). The deprecated spellings own and own:<c> are still accepted, with a
// deprecation warning printed once to stderr.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>

namespace fused_dense::core {

// The cutlass_sm90 kernels number their variants configuration * kCutlassOrders + order: one of
// the kernel's tile configurations, run with one of kCutlassOrders tile-scheduler orders.
inline constexpr int kCutlassOrders = 3;

struct Choice {
  bool fused = false;
  int algorithm = 0;  // index into the fused epilogue's or the plain GEMM's algorithm list
  int cutlass = -1;   // >= 0: this variant of a cutlass_sm90 kernel instead (fused, algorithm unused)
  bool operator==(const Choice& o) const {
    return fused == o.fused && algorithm == o.algorithm && cutlass == o.cutlass;
  }
};

// What identifies a problem for tuning: op kind, dtype, shape and epilogue flags.
struct TuningKey {
  std::array<int64_t, 10> v{};
  bool operator==(const TuningKey& o) const { return v == o.v; }
};

// Candidate runner: enqueue one run of `choice` on the stream; false when cuBLASLt refuses it.
using CandidateRunner = std::function<bool(const Choice&)>;

// The per-call path: true (and *choice set) when key was tuned already, in this process or in
// the persisted cache.
bool cached_choice(int device, const TuningKey& key, Choice* choice);

// Measures the candidates and caches the best for key. When the stream is being captured into a
// CUDA graph, or tuning is disabled, returns `fallback` without measuring (and without caching
// it, so a later eager call still tunes).
Choice tune(int device, const TuningKey& key, const std::string& description, int fused_algorithms,
            int plain_algorithms, int cutlass_variants, const Choice& fallback, const CandidateRunner& run,
            cudaStream_t stream);

}  // namespace fused_dense::core
