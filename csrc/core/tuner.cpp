#include "tuner.h"

#include <cublasLt.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "cuda_check.h"
#include "device_info.h"
#include "key_hash.h"

namespace fused_dense::core {
namespace {

// Bounds on one problem's tuning: a handful of candidates, timed in a few rounds of a couple of
// runs each after a warm-up, and a wall-clock budget after which the rounds done so far decide
// (large problems take ~15 ms per GEMM).
constexpr int kMaxFusedCandidates = 8;
constexpr int kMaxPlainCandidates = 4;
constexpr int kTimedRuns = 2;
constexpr int kRounds = 3;
constexpr float kWarmupMs = 20.0f;
constexpr int kMaxWarmupRuns = 100;
constexpr double kBudgetMs = 1500.0;
constexpr float kMinGain = 0.02f;  // the fraction by which a candidate must beat the rule's choice

struct TuningKeyHash {
  std::size_t operator()(const TuningKey& k) const { return IntArrayHash{}(k.v); }
};

// (A deleter has no caller to report a failed destroy to, so its status is dropped.)
struct EventDeleter {
  void operator()(CUevent_st* e) const { cudaEventDestroy(e); }
};
using Event = std::unique_ptr<CUevent_st, EventDeleter>;
Event make_event() {
  cudaEvent_t e = nullptr;
  FD_CUDA_CHECK(cudaEventCreate(&e));
  return Event(e);
}

bool env_flag(const char* name, bool default_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_value;
  return !(v[0] == '0' && v[1] == '\0');
}

// A persisted choice is only valid for the same GPU model and cuBLASLt build, and for the same
// numbering of the cutlass_sm90 variants (kCutlassVariantLayout: raise it when that numbering
// changes, so a file written by another build is ignored rather than read as other kernels).
// Lines whose tag differs, in any part, are stale: not read, and measured afresh.
constexpr int kCutlassVariantLayout = 2;
std::string device_tag(int device) {
  const DeviceInfo& info = device_info(device);
  std::string name = info.name();
  for (char& c : name)
    if (c == ' ' || c == '\t') c = '_';
  std::ostringstream tag;
  tag << name << "/sm" << info.cc_major() << info.cc_minor() << "/cublasLt" << cublasLtGetVersion()
      << "/cutlass" << kCutlassVariantLayout;
  return tag.str();
}

class ChoiceCache {
 public:
  bool lookup(int device, const TuningKey& key, Choice* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& table = table_for(device);
    auto it = table.find(key);
    if (it == table.end()) return false;
    *out = it->second;
    return true;
  }

  // persist = false keeps the choice for this process only: the rule's choice taken because
  // nothing could be measured says nothing another process should reuse.
  void insert(int device, const TuningKey& key, const Choice& choice, bool persist = true) {
    std::lock_guard<std::mutex> lock(mutex_);
    table_for(device)[key] = choice;
    if (!persist) return;
    const char* path = std::getenv("FUSED_DENSE_TUNING_CACHE");
    if (path == nullptr || *path == '\0') return;
    std::ofstream file(path, std::ios::app);
    if (!file) return;  // persistence is an optimisation; an unwritable path only costs re-tuning
    file << tags_[device];
    for (int64_t x : key.v) file << ' ' << x;
    file << ' ' << (choice.fused ? 1 : 0) << ' ' << choice.algorithm << ' ' << choice.cutlass << '\n';
  }

 private:
  using Table = std::unordered_map<TuningKey, Choice, TuningKeyHash>;

  // Caller holds mutex_.
  Table& table_for(int device) {
    auto it = tables_.find(device);
    if (it != tables_.end()) return it->second;
    Table& table = tables_[device];
    tags_[device] = device_tag(device);
    load(tags_[device], &table);
    return table;
  }

  static void load(const std::string& tag, Table* table) {
    const char* path = std::getenv("FUSED_DENSE_TUNING_CACHE");
    if (path == nullptr || *path == '\0') return;
    std::ifstream file(path);
    std::string line;
    while (std::getline(file, line)) {
      std::istringstream in(line);
      std::string line_tag;
      TuningKey key;
      int fused = 0;
      Choice choice;
      in >> line_tag;
      for (auto& x : key.v) in >> x;
      in >> fused >> choice.algorithm >> choice.cutlass;
      if (!in || line_tag != tag || choice.algorithm < 0) continue;  // another GPU or build, or a torn line
      choice.fused = fused != 0;
      (*table)[key] = choice;
    }
  }

  std::mutex mutex_;
  std::map<int, Table> tables_;
  std::map<int, std::string> tags_;
};

ChoiceCache& choice_cache() {
  static ChoiceCache* cache = new ChoiceCache();  // lives until exit, like the plans it indexes
  return *cache;
}

void announce_first_tuning() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "fused_dense: heuristic='auto' measures the candidate algorithms of each new problem "
                 "shape once (FUSED_DENSE_TUNING_VERBOSE=1 prints each choice, FUSED_DENSE_TUNING=0 "
                 "turns measuring off)\n");
  });
}

// FUSED_DENSE_TUNING_CANDIDATES: which kinds of candidate to measure (all when unset).
struct CandidateKinds {
  bool fused = true, unfused = true, cutlass = true;
  int cutlass_config = -1;  // >= 0: only the cutlass_sm90 variants of this tile configuration
};

// "own" (and own:<c>) is a deprecated alias of the candidate kind cutlass (cutlass:<c>): still
// accepted, with this warning printed once per process.
void warn_deprecated_own_spelling() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "fused_dense: FUSED_DENSE_TUNING_CANDIDATES: 'own' is deprecated, write 'cutlass' "
                 "('own:<c>': 'cutlass:<c>')\n");
  });
}

// Parses "<kind>" or "<kind>:<configuration>" for kind = cutlass (or its deprecated spelling);
// false when word is neither.
bool parse_cutlass_word(const std::string& word, const std::string& kind, CandidateKinds* kinds) {
  if (word == kind) {
    kinds->cutlass = true;
    return true;
  }
  const std::size_t digits = word.size() - std::min(word.size(), kind.size() + 1);
  if (digits < 1 || digits > 2 || word.compare(0, kind.size() + 1, kind + ":") != 0 ||
      word.find_first_not_of("0123456789", kind.size() + 1) != std::string::npos)
    return false;
  kinds->cutlass = true;
  kinds->cutlass_config = std::stoi(word.substr(kind.size() + 1));
  return true;
}

CandidateKinds candidate_kinds() {
  const char* v = std::getenv("FUSED_DENSE_TUNING_CANDIDATES");
  if (v == nullptr || *v == '\0') return {};
  CandidateKinds kinds{false, false, false};
  std::stringstream list(v);
  std::string word;
  while (std::getline(list, word, ',')) {
    if (word == "fused") {
      kinds.fused = true;
    } else if (word == "unfused") {
      kinds.unfused = true;
    } else if (parse_cutlass_word(word, "own", &kinds)) {
      warn_deprecated_own_spelling();
    } else if (!parse_cutlass_word(word, "cutlass", &kinds)) {
      throw Error("fused_dense: FUSED_DENSE_TUNING_CANDIDATES must be a comma-separated list of fused, "
                  "unfused and cutlass (or cutlass:<tile configuration>, a number), got '" + std::string(v) + "'");
    }
  }
  return kinds;
}

// " (tile configuration c, order o)" for a cutlass_sm90 variant, else empty.
std::string cutlass_variant_detail(const Choice& c) {
  if (c.cutlass < 0) return {};
  return " (tile configuration " + std::to_string(c.cutlass / kCutlassOrders) + ", order " +
         std::to_string(c.cutlass % kCutlassOrders) + ")";
}

const char* choice_kind(const Choice& c) {
  return c.cutlass >= 0 ? "cutlass_sm90 variant" : c.fused ? "fused" : "unfused";
}

}  // namespace

bool cached_choice(int device, const TuningKey& key, Choice* choice) {
  return choice_cache().lookup(device, key, choice);
}

Choice tune(int device, const TuningKey& key, const std::string& description, int fused_algorithms,
            int plain_algorithms, int cutlass_variants, const Choice& fallback, const CandidateRunner& run,
            cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone || !env_flag("FUSED_DENSE_TUNING", true)) return fallback;
  announce_first_tuning();

  // When nothing can be measured, the rule's choice is remembered for this process (not persisted:
  // another process may allow other candidates), so later calls skip the warm-up below.
  auto keep_rule_choice = [&] {
    choice_cache().insert(device, key, fallback, /*persist=*/false);
    return fallback;
  };

  const CandidateKinds kinds = candidate_kinds();
  std::vector<Choice> candidates;
  if (kinds.fused)
    for (int i = 0; i < std::min(fused_algorithms, kMaxFusedCandidates); ++i) candidates.push_back({true, i});
  if (kinds.unfused)
    for (int i = 0; i < std::min(plain_algorithms, kMaxPlainCandidates); ++i) candidates.push_back({false, i});
  if (kinds.cutlass)
    for (int i = 0; i < cutlass_variants; ++i)
      if (kinds.cutlass_config < 0 || i / kCutlassOrders == kinds.cutlass_config) candidates.push_back({false, 0, i});
  // Nothing of the kinds asked for applies (e.g. cutlass:<c> past a kernel's configurations).
  if (candidates.empty()) return keep_rule_choice();

  Event start = make_event(), stop = make_event();
  const auto t0 = std::chrono::steady_clock::now();
  auto spent_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  // One timed batch of `c`; negative when cuBLASLt rejects it.
  auto time_ms = [&](const Choice& c, int runs) -> float {
    try {
      FD_CUDA_CHECK(cudaEventRecord(start.get(), stream));
      for (int r = 0; r < runs; ++r)
        if (!run(c)) return -1.f;
      FD_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
      FD_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    } catch (const Error&) {
      return -1.f;  // an algorithm the heuristic listed but the launch rejected is simply not a candidate
    }
    float ms = 0.f;
    FD_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms / static_cast<float>(runs);
  };

  // Warm-up: the GPU's clocks ramp under load, so whichever candidate went first would look slow.
  // Run the rule's choice (else the first accepted candidate) for kWarmupMs before timing anything.
  // (With the candidate kinds restricted, the rule's choice may not be among them.)
  Choice warm = candidates.front();
  for (const Choice& c : candidates)
    if (c == fallback) warm = fallback;
  float warm_ms = time_ms(warm, 1);
  for (std::size_t i = 0; warm_ms < 0.f && i < candidates.size(); ++i) warm_ms = time_ms(warm = candidates[i], 1);
  // Every candidate rejected at launch: measuring again would not change that.
  if (warm_ms < 0.f) return keep_rule_choice();
  const int warm_runs = std::clamp(static_cast<int>(kWarmupMs / std::max(warm_ms, 1e-3f)), 0, kMaxWarmupRuns);
  if (warm_runs > 0) time_ms(warm, warm_runs);

  // Rounds over all candidates, keeping each one's best batch: a transient slowdown (another
  // process, a clock dip) then costs a candidate one round, not the decision.
  std::vector<float> best_of(candidates.size(), std::numeric_limits<float>::infinity());
  std::vector<bool> rejected(candidates.size(), false);
  int rounds = 0;
  for (; rounds < kRounds; ++rounds) {
    if (rounds > 0 && spent_ms() > kBudgetMs) break;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      if (rejected[i]) continue;
      const float ms = time_ms(candidates[i], kTimedRuns);
      if (ms < 0.f) {
        rejected[i] = true;
        continue;
      }
      best_of[i] = std::min(best_of[i], ms);
    }
  }
  Choice best = fallback;
  float best_ms = std::numeric_limits<float>::infinity();
  float fallback_ms = std::numeric_limits<float>::quiet_NaN();
  int measured = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (rejected[i] || !(best_of[i] < std::numeric_limits<float>::infinity())) continue;
    ++measured;
    const Choice& c = candidates[i];
    if (c == fallback) fallback_ms = best_of[i];
    if (best_of[i] < best_ms) {
      best_ms = best_of[i];
      best = c;
    }
  }
  // The rule's choice stays unless another beats it clearly: a 1% difference is within what
  // repeating the measurement moves, and a switch on noise is a loss as likely as a gain.
  if (!std::isnan(fallback_ms) && best_ms > fallback_ms * (1.0f - kMinGain)) {
    best = fallback;
    best_ms = fallback_ms;
  }
  if (measured == 0) return keep_rule_choice();
  const char* verbose = std::getenv("FUSED_DENSE_TUNING_VERBOSE");
  if (verbose != nullptr && *verbose != '\0' && std::string(verbose) != "0") {
    std::fprintf(stderr,
                 "fused_dense: tuned %s: %s %d%s, %.4f ms (rule's choice: %.4f ms), %d candidates, %d "
                 "rounds\n",
                 description.c_str(), choice_kind(best), best.cutlass >= 0 ? best.cutlass : best.algorithm,
                 cutlass_variant_detail(best).c_str(), best_ms, fallback_ms, measured, rounds);
    if (std::string(verbose) == "2")  // every candidate's best batch, for probing the variants
      for (std::size_t i = 0; i < candidates.size(); ++i)
        std::fprintf(stderr, "fused_dense:   candidate %s %d%s: %.4f ms\n", choice_kind(candidates[i]),
                     candidates[i].cutlass >= 0 ? candidates[i].cutlass : candidates[i].algorithm,
                     cutlass_variant_detail(candidates[i]).c_str(), rejected[i] ? -1.f : best_of[i]);
  }
  choice_cache().insert(device, key, best);
  return best;
}

}  // namespace fused_dense::core
