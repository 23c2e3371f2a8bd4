// Measured choice for heuristic = auto. A problem is keyed by its op, dtype, widths, flags and the
// representative of its token count M (m_bucket: the token counts people use, 2^k and the round
// counts between, each measured at its exact M; another M takes the nearest of them, until its
// own exact M is measured: key_exact_m). The
// candidates are the fused epilogue with several of cuBLASLt's algorithms, plain GEMM +
// elementwise kernel with several plain algorithms, and where it applies each variant of the
// library's cutlass_sm90 kernels (cutlass_sm90_dgrad.h, cutlass_sm90_forward.h); they are timed on
// the caller's stream as the benchmark times (L2 flushed before every run, candidates interleaved
// round after round, repeated until the winner's margin over the runner-up exceeds the spread or
// the problem's budget is spent) and the fastest is kept, process-wide. A choice stores the
// cuBLASLt algorithm itself (cublasLtMatmulAlgo_t), which gemm.h checks for each new M.
//
// The one entry is choose(): an op (linear.cpp's dispatch, for linear_act and the other ops of
// linear.h and gated.h) builds its key, a builder of the rule's choice and a builder of the
// measurement, and asks once. choose() returns, in order:
//   1. the key's choice in this process: measured here, read from the user's cache file
//      (FUSED_DENSE_TUNING_CACHE) or the table shipped with the package for the GPU's compute
//      capability and cuBLASLt major.minor (FUSED_DENSE_TUNING_TABLE=0 leaves it out, =path reads
//      another; both files are read on a device's first lookup), or imported (import_choices);
//   2. a provisional choice (the rule's, kept while measuring was not allowed) as long as measuring
//      is still not allowed (disabled, CUDA-graph capture, the budget of TuningSettings spent);
//   3. else, with the rule's choice built (rule()), where measuring is allowed now: the op's
//      candidates, built on synthetic operands in a TuningArena (trial()) and timed; the fastest
//      is kept (the rule's choice unless another beats it by tuner.cpp's kMinGain);
//   4. else the rule's choice (the fused epilogue or plain GEMM with cuBLASLt's first algorithm
//      at the representative M; where measuring is not allowed or the arena cannot hold the
//      operands), kept as provisional and measured on a later call that may.
// With `fixed` (deterministic mode: torch.use_deterministic_algorithms(True), or
// TuningSettings::deterministic) nothing is timed and no choice timed in this process is used:
// only the table, the cache file and imported choices, else the rule's choice (kept for the key).
// Two processes with the same files then choose alike, whatever their timings.
// On a key's cached choice choose() allocates nothing and builds neither the rule's choice nor
// the candidates. The choices made in this process are bounded (kMaxProcessChoices per device,
// least recently made dropped first); those read from files or imported are not counted.
//
// Environment (read once; TuningSettings set from Python override them):
//   FUSED_DENSE_TUNING=0                   never measure (table, cache and rule only)
//   FUSED_DENSE_TUNING_DETERMINISTIC=1|0   deterministic mode for every call (see `fixed` above);
//                                          default 1 where WORLD_SIZE > 1 (one rank of several)
//   FUSED_DENSE_TUNING_BUDGET=s            seconds of measuring per process (default 30)
//   FUSED_DENSE_TUNING_PROBLEM_BUDGET_MS=ms  per problem (default 100)
//   FUSED_DENSE_TUNING_PACE=f              share of wall time measuring may take (default 0.05)
//   FUSED_DENSE_TUNING_BUCKETS=b           representatives per octave: 1, 2, 4 (default), 8; 0: exact M
//   FUSED_DENSE_TUNING_REFINE=1|0          measure a count that is no representative at its exact M
//                                          where measuring is allowed (default 1; key_exact_m)
//   FUSED_DENSE_TUNING_CACHE=path          persist choices across processes (one line each)
//   FUSED_DENSE_TUNING_TABLE=0|path        leave the shipped table out, or read another
//   FUSED_DENSE_TUNING_VERBOSE=1|2         print each choice (2: every candidate's time)
//   FUSED_DENSE_TUNING_CANDIDATES=cutlass,fused,unfused (any subset, comma-separated) restricts
//     the kinds of candidates measured; the tests use it to pin a path. cutlass:<c> in place of
//     cutlass measures only the cutlass_sm90 variants of tile configuration c. The deprecated
//     spellings own and own:<c> are still accepted, with a deprecation warning printed once.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/common/cutlass_variants.h"
#include "core/common/function_ref.h"

namespace fused_dense::core {

struct Choice {
  bool fused = false;
  int algorithm = 0;  // index into the fused epilogue's or the plain GEMM's list (has_algo false)
  int cutlass = -1;   // >= 0: this variant of a cutlass_sm90 kernel instead (fused, algorithm unused)
  bool has_algo = false;      // 'auto': run `algo` (checked for the call's problem) instead of the index
  cublasLtMatmulAlgo_t algo{};
  bool operator==(const Choice& o) const;
};

// The bucket of a token count M on a grid of b representatives per octave: the counts below 16
// are their own; from 16 up the representatives are 2^k (1 + j / b), j = 0 .. b - 1 (b = 4: 8192,
// 10240, 12288, 14336, 16384, ...; every power of two and 1.5 * 2^k for b >= 2), and M takes the
// nearest one by ratio (M itself where it is one). With b = 0, M is its own bucket.
struct MBucket {
  int64_t index = 0;           // what the tuning key holds: the representative
  int64_t representative = 0;  // the M measured for the whole bucket
  int per_octave = 0;          // the grid it was taken on (0: exact M)
};
MBucket m_bucket(int64_t m);
// The representatives of the current grid in [lo, hi], ascending (what a table is measured at).
std::vector<int64_t> m_representatives(int64_t lo, int64_t hi);

struct TuningSettings {
  bool enabled = true;             // measure at all
  double budget_s = 30.0;          // per process
  double problem_budget_ms = 100.0;  // per problem: rounds stop once it is spent
  // Pacing of budget_s: measuring may use at most 0.1 s plus this fraction of the wall time since
  // the process's first measurement (>= 1: unpaced), so a run that meets a new problem at every
  // step spends a bounded share of its time measuring and later steps measure what earlier ones
  // could not.
  double pace = 0.05;
  // Representatives per octave of M: 4 (the default, and the shipped table's grid), 1, 2 or 8; 0
  // keys by the exact M. A choice is stored for the grid it was measured on.
  int buckets = 4;
  // A token count that is no representative is measured at its exact M where measuring is allowed
  // (key_exact_m); false: it always takes its bucket's choice.
  bool refine = true;
  // Deterministic mode for every call (choose()'s `fixed`), beside torch's own switch.
  bool deterministic = false;
  std::string cache_path;   // empty: none
  std::string table_path;   // empty: none
};
TuningSettings tuning_settings();
// Replaces the settings. A changed cache or table path forgets the choices read from files (they
// are read again on the next call); measured choices stay.
void set_tuning_settings(const TuningSettings& settings);
// The table the package ships, used unless FUSED_DENSE_TUNING_TABLE says otherwise (set once by
// the Python layer at import).
void set_default_tuning_table(const std::string& path);

struct TuningStats {
  int64_t problems_measured = 0;
  int64_t rule_choices = 0;       // problems given the rule's choice (nothing measured)
  int64_t table_choices = 0;      // entries read from the shipped table
  int64_t cache_choices = 0;      // entries read from the cache file
  double measuring_s = 0.0;       // time spent measuring
  int64_t heuristic_queries = 0;  // cuBLASLt algorithm lists built (gemm.h)
  int64_t imported_choices = 0;   // entries taken by import_choices
  int64_t process_choices = 0;    // choices made in this process now held (bounded)
  int64_t plans_cached = 0;       // GEMM plans now held (gemm.h, bounded)
};
TuningStats tuning_stats();

// What identifies a problem for tuning: op kind, dtype, M bucket, widths and epilogue flags.
struct TuningKey {
  std::array<int64_t, 10> v{};
  bool operator==(const TuningKey& o) const { return v == o.v; }
};

// Candidate runner: enqueue one run of `choice` on the stream; false when it is refused.
using CandidateRunner = std::function<bool(const Choice&)>;

class TuningArena;  // tuning_arena.h

// What an op measures: its candidates on synthetic operands at the bucket's representative M, a
// runner of each on those operands, and the problem's description (FUSED_DENSE_TUNING_VERBOSE).
struct TuningTrial {
  std::vector<Choice> candidates;
  CandidateRunner run;
  std::string description;
  // How many of the plain GEMM's algorithms (the first of cuBLASLt's list) are measured: 4 beside
  // fused epilogues and cutlass_sm90 kernels; 8 for the FP8 GEMM, whose candidates are all plain
  // (its best at a Llama layer's forward shapes was the 5th to 8th of the list: docs/performance.md,
  // "FP8 GEMMs under 'auto'").
  int max_plain = 4;
};

// The choice for key on this device (the steps above). rule(): the rule's choice at the bucket's
// representative M; trial(arena): the candidates and their runner on operands taken from arena
// (which frees them when choose() returns), or nullopt when arena.ok() turned false. Each is
// called only where the key has no choice to return as it is, and trial() only when measuring.
// fixed: deterministic mode (above).
Choice choose(int device, cudaStream_t stream, const TuningKey& key, bool fixed, FunctionRef<Choice()> rule,
              FunctionRef<std::optional<TuningTrial>(TuningArena&)> trial);

// Whether a call whose token count is no representative of its bucket is keyed by its exact M
// (exact_key: the key with MBucket{M, M, 0}) rather than by the bucket: where the exact M has a
// final choice in this process, or measuring is allowed now (choose() then measures it there).
// In deterministic mode (fixed) only where the cache file or imported choices hold the exact M's
// (nothing is measured); never with refine off. Otherwise the bucket's choice serves the count
// provisionally, as the rule's choice serves a problem met while measuring is not allowed. Why: the best algorithm moves with the exact M's tile and wave counts, so a count 1%
// from its representative can lose 14% on the representative's choice (docs/performance.md,
// "The tuner").
bool key_exact_m(int device, cudaStream_t stream, const TuningKey& exact_key, bool fixed);

// The final choices this device holds (measured here, read from files, imported) as lines of the
// cache file's format, for sharing one process's choices with others (a process group).
std::vector<std::string> export_choices(int device);
// Takes lines of export_choices (another process's) for this device: lines of another tag are
// skipped. They serve deterministic mode too, and win over this process's own. Returns how many
// were taken.
int64_t import_choices(int device, const std::vector<std::string>& lines);

}  // namespace fused_dense::core
