#include "core/tuning/tuner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "core/common/cuda_check.h"
#include "core/common/device_info.h"
#include "core/gemm/gemm.h"
#include "core/common/key_hash.h"
#include "core/tuning/tuning_arena.h"

namespace fused_dense::core {

bool Choice::operator==(const Choice& o) const {
  if (fused != o.fused || cutlass != o.cutlass || has_algo != o.has_algo) return false;
  if (has_algo) return std::memcmp(algo.data, o.algo.data, sizeof(algo.data)) == 0;
  return algorithm == o.algorithm;
}

namespace {

// Bounds on one problem's tuning: a handful of candidates, each run timed alone after an L2 flush,
// in rounds over all of them (at least kMinRounds, at most kMaxRounds) after a warm-up, within the
// problem's budget. From kMinRounds on, a round stops the measuring when the winner's margin over
// the runner-up exceeds the spread of either one's runs; a candidate whose best run is kDropAbove
// times the winner's median or more is not run again.
constexpr int kMaxFusedCandidates = 8;
constexpr int kMinRounds = 3;
constexpr int kMaxRounds = 15;
constexpr float kDropAbove = 1.10f;
constexpr float kWarmupMs = 20.0f;
constexpr int kMaxWarmupRuns = 100;
constexpr double kWarmGapS = 0.2;  // a GPU that measured this recently is still at its clocks
// A problem whose run takes kSustainAboveMs or more sets its own clock: at the power cap the GPU
// lowers its clock over tens of milliseconds of a kernel that draws more power per cycle, and a
// training step runs such a GEMM back to back with its neighbours, at the clock it settles to.
// Timed alone after other candidates' runs, such a kernel still runs at the clock the previous
// candidate left (H200, bf16 16384 x 8192 -> 32768 with GELU: the cutlass_sm90 kernel read
// 12.6 ms that way against 14.1 ms for cuBLASLt's fused algorithm, and 14.7 ms at 1200 MHz
// against 13.4 ms at 1425 MHz back to back; docs/performance.md, "The tuner"). So each of its
// candidates is timed right after kLeadInMs of its own runs, unflushed (its operands are many
// times the L2).
constexpr float kSustainAboveMs = 2.0f;
constexpr float kLeadInMs = 60.0f;
constexpr float kMinGain = 0.02f;  // the fraction by which a candidate must beat the rule's choice
// What the pacing (TuningSettings::pace) allows before the first measurement has aged.
constexpr double kInitialAllowanceS = 0.1;

// Versions of what a stored line means: raise kChoiceFormat when the key, the line or the
// numbering of the cutlass_sm90 variants changes, so files written by another build are ignored
// rather than read as other choices.
constexpr int kChoiceFormat = 5;

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

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v == nullptr || *v == '\0') ? nullptr : v;
}

bool env_flag(const char* name, bool default_value) {
  const char* v = env(name);
  if (v == nullptr) return default_value;
  return !(v[0] == '0' && v[1] == '\0');
}

double env_number(const char* name, double default_value, double lowest) {
  const char* v = env(name);
  if (v == nullptr) return default_value;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(x >= lowest))
    throw Error(std::string("fused_dense: ") + name + " must be a number >= " + std::to_string(lowest) + ", got '" +
                v + "'");
  return x;
}

bool valid_bucket_grid(double b) { return b == 0 || b == 1 || b == 2 || b == 4 || b == 8; }

// The settings, the default table's path, the budget spent and the counters: one lock.
struct TunerState {
  std::mutex mutex;
  bool initialized = false;
  TuningSettings settings;
  std::string default_table;
  bool table_from_env = false;
  uint64_t files_generation = 0;  // bumped when the cache or table path changes
  double spent_s = 0.0;
  std::optional<std::chrono::steady_clock::time_point> first_measured, last_measured;
  TuningStats stats;
};

TunerState& state() {
  static TunerState* s = new TunerState();  // lives until exit, like the choices it governs
  return *s;
}

// Caller holds the lock.
void initialize_locked(TunerState& st) {
  if (st.initialized) return;
  st.settings.enabled = env_flag("FUSED_DENSE_TUNING", true);
  // A process launched as one rank of several (torchrun, and the launchers that follow it, set
  // WORLD_SIZE) starts in deterministic mode: ranks that timed their own problems could choose
  // differently and compute different bits. FUSED_DENSE_TUNING_DETERMINISTIC=0 (or
  // fused_dense.tuning's configure / measure_and_share) says otherwise.
  const char* world = env("WORLD_SIZE");
  const bool one_of_many_ranks = world != nullptr && std::atol(world) > 1;
  st.settings.deterministic = env_flag("FUSED_DENSE_TUNING_DETERMINISTIC", one_of_many_ranks);
  st.settings.budget_s = env_number("FUSED_DENSE_TUNING_BUDGET", st.settings.budget_s, 0.0);
  st.settings.problem_budget_ms = env_number("FUSED_DENSE_TUNING_PROBLEM_BUDGET_MS", st.settings.problem_budget_ms, 0.0);
  st.settings.pace = env_number("FUSED_DENSE_TUNING_PACE", st.settings.pace, 0.0);
  const double buckets = env_number("FUSED_DENSE_TUNING_BUCKETS", st.settings.buckets, 0.0);
  if (!valid_bucket_grid(buckets))
    throw Error("fused_dense: FUSED_DENSE_TUNING_BUCKETS must be 0, 1, 2, 4 or 8 (representatives per octave of M), got '" +
                std::string(env("FUSED_DENSE_TUNING_BUCKETS")) + "'");
  st.settings.buckets = static_cast<int>(buckets);
  st.settings.refine = env_flag("FUSED_DENSE_TUNING_REFINE", st.settings.refine);
  if (const char* c = env("FUSED_DENSE_TUNING_CACHE")) st.settings.cache_path = c;
  if (const char* t = env("FUSED_DENSE_TUNING_TABLE")) {
    st.table_from_env = true;
    st.settings.table_path = std::string(t) == "0" ? std::string() : std::string(t);
  } else {
    st.settings.table_path = st.default_table;
  }
  st.initialized = true;
}

TuningSettings current_settings() {
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  initialize_locked(st);
  return st.settings;
}

// The tag of a stored line: the choices hold for every GPU of the compute capability under the
// same cuBLASLt major.minor (each algorithm is checked before use, cublasLtMatmulAlgoCheck, so
// another GPU model or patch release only costs a check), and for the same line format.
std::string device_tag(int device) {
  const DeviceInfo& info = device_info(device);
  const std::size_t version = cublasLtGetVersion();  // major * 10000 + minor * 100 + patch
  std::ostringstream tag;
  tag << "sm" << info.cc_major() << info.cc_minor() << "/cublasLt" << version / 10000 << "." << (version / 100) % 100
      << "/choices" << kChoiceFormat;
  return tag.str();
}

void write_choice(std::ostream& out, const Choice& c) {
  out << (c.fused ? 1 : 0) << ' ' << c.algorithm << ' ' << c.cutlass << ' ' << (c.has_algo ? 1 : 0);
  char word[24];
  for (uint64_t x : c.algo.data) {
    std::snprintf(word, sizeof(word), " %016" PRIx64, x);
    out << word;
  }
}

bool read_choice(std::istream& in, Choice* c) {
  int fused = 0, has_algo = 0;
  in >> fused >> c->algorithm >> c->cutlass >> has_algo;
  for (uint64_t& x : c->algo.data) {
    std::string word;
    in >> word;
    if (!in || word.size() != 16 || word.find_first_not_of("0123456789abcdef") != std::string::npos) return false;
    x = std::strtoull(word.c_str(), nullptr, 16);
  }
  c->fused = fused != 0;
  c->has_algo = has_algo != 0;
  return static_cast<bool>(in) && c->algorithm >= 0;
}

enum class CachedKind { kNone, kProvisional, kFinal };

// Where a cached choice came from.
enum class Source { kMeasured, kRule, kProvisional, kFile, kImported };

bool from_outside(Source s) { return s == Source::kFile || s == Source::kImported; }

// Bounds the choices made in this process per device (measured, the rule's, provisional; and the
// rule's choices of deterministic mode), least recently made dropped first: with exact-M keys a
// process meeting ever new token counts would otherwise grow without end. Entries read from files
// or imported are what the user gave and are not dropped.
constexpr std::size_t kMaxProcessChoices = 4096;

// The choices of this process, per device: measured here, in the cache file, in the table or
// imported (final); the rule's choice kept while measuring is not allowed (provisional: the budget,
// CUDA-graph capture), measured later when it is; and, apart, the rule's choices of deterministic
// mode, which never reads a choice timed in this process.
class ChoiceCache {
 public:
  CachedKind lookup(int device, const TuningKey& key, bool fixed, Choice* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    Tables& t = tables_for(device);
    auto it = t.choices.find(key);
    if (it != t.choices.end() && (!fixed || from_outside(it->second.source))) {
      *out = it->second.choice;
      return it->second.source == Source::kProvisional ? CachedKind::kProvisional : CachedKind::kFinal;
    }
    if (!fixed) return CachedKind::kNone;
    auto r = t.fixed_rules.find(key);
    if (r == t.fixed_rules.end()) return CachedKind::kNone;
    *out = r->second.choice;
    return CachedKind::kFinal;
  }

  // source kProvisional: the rule's choice taken because measuring was not allowed; replaced once
  // it is. persist = false: kept for this process only (the rule's choice where no candidate
  // applied or ran says nothing another process, with other settings, should reuse).
  void insert(int device, const TuningKey& key, const Choice& choice, Source source, bool persist = true) {
    std::lock_guard<std::mutex> lock(mutex_);
    Tables& t = tables_for(device);
    put(t, t.choices, key, choice, source);
    if (source != Source::kMeasured || !persist) return;
    const std::string path = current_settings().cache_path;
    if (path.empty()) return;
    std::ofstream file(path, std::ios::app);
    if (!file) return;  // persistence is an optimisation; an unwritable path only costs re-tuning
    write_line(file, t.tag, key, choice);
  }

  // The rule's choice of deterministic mode for key.
  void insert_fixed_rule(int device, const TuningKey& key, const Choice& choice) {
    std::lock_guard<std::mutex> lock(mutex_);
    Tables& t = tables_for(device);
    put(t, t.fixed_rules, key, choice, Source::kRule);
  }

  std::vector<std::string> export_lines(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    Tables& t = tables_for(device);
    std::vector<std::string> lines;
    for (const auto& [key, e] : t.choices) {
      if (e.source == Source::kRule || e.source == Source::kProvisional) continue;
      std::ostringstream line;
      write_line(line, t.tag, key, e.choice);
      std::string text = line.str();
      text.pop_back();  // the newline
      lines.push_back(std::move(text));
    }
    std::sort(lines.begin(), lines.end());
    return lines;
  }

  int64_t import_lines(int device, const std::vector<std::string>& lines) {
    std::lock_guard<std::mutex> lock(mutex_);
    Tables& t = tables_for(device);
    int64_t taken = 0;
    for (const std::string& line : lines) {
      TuningKey key;
      Choice choice;
      if (!parse_line(line, t.tag, &key, &choice)) continue;
      put(t, t.choices, key, choice, Source::kImported);
      ++taken;
    }
    return taken;
  }

  int64_t process_choices() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t n = 0;
    for (const auto& [device, t] : tables_) n += static_cast<int64_t>(t.order.size());
    return n;
  }

 private:
  struct Entry {
    Choice choice;
    Source source = Source::kMeasured;
    bool in_order = false;                        // counted in Tables::order
    std::list<std::pair<bool, TuningKey>>::iterator order_it;
  };
  using Table = std::unordered_map<TuningKey, Entry, TuningKeyHash>;
  struct Tables {
    Table choices, fixed_rules;
    // The process-made entries of both tables, least recently made first: (in fixed_rules, key).
    std::list<std::pair<bool, TuningKey>> order;
    std::string tag;
    uint64_t generation = 0;
  };

  // Caller holds mutex_. Stores (choice, source) for key in `table` (t.choices or t.fixed_rules), keeping the
  // process-made entries within kMaxProcessChoices.
  static void put(Tables& t, Table& table, const TuningKey& key, const Choice& choice, Source source) {
    Entry e;
    e.choice = choice;
    e.source = source;
    const bool fixed_table = &table == &t.fixed_rules;
    auto it = table.find(key);
    if (it != table.end() && it->second.in_order) t.order.erase(it->second.order_it);
    if (!from_outside(e.source)) {
      t.order.emplace_back(fixed_table, key);
      e.in_order = true;
      e.order_it = std::prev(t.order.end());
    }
    table[key] = e;
    while (t.order.size() > kMaxProcessChoices) {
      const auto [in_fixed, old] = t.order.front();
      (in_fixed ? t.fixed_rules : t.choices).erase(old);
      t.order.pop_front();
    }
  }

  static void write_line(std::ostream& out, const std::string& tag, const TuningKey& key, const Choice& choice) {
    out << tag;
    for (int64_t x : key.v) out << ' ' << x;
    out << ' ';
    write_choice(out, choice);
    out << '\n';
  }

  static bool parse_line(const std::string& line, const std::string& tag, TuningKey* key, Choice* choice) {
    if (line.empty() || line[0] == '#') return false;
    std::istringstream in(line);
    std::string line_tag;
    in >> line_tag;
    for (auto& x : key->v) in >> x;
    return in && line_tag == tag && read_choice(in, choice);  // else another GPU or build, or a torn line
  }

  // Caller holds mutex_. The files are read on a device's first lookup, and again after
  // set_tuning_settings changed their paths (choices made here and imported ones are kept).
  Tables& tables_for(int device) {
    const uint64_t generation = files_generation();
    auto found = tables_.find(device);
    if (found != tables_.end() && found->second.generation == generation) return found->second;
    Tables& t = tables_[device];
    for (auto e = t.choices.begin(); e != t.choices.end();)
      e = e->second.source == Source::kFile ? t.choices.erase(e) : std::next(e);
    t.generation = generation;
    t.tag = device_tag(device);
    const TuningSettings settings = current_settings();
    // the cache file's lines (this GPU's own measurements) win over the shipped table's
    const int64_t from_table = load(settings.table_path, t, /*overwrite=*/false);
    const int64_t from_cache = load(settings.cache_path, t, /*overwrite=*/true);
    TunerState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    st.stats.table_choices += from_table;
    st.stats.cache_choices += from_cache;
    return t;
  }

  static uint64_t files_generation() {
    TunerState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    return st.files_generation;
  }

  // A file's lines for this tag; an entry already there that was imported is kept.
  static int64_t load(const std::string& path, Tables& t, bool overwrite) {
    if (path.empty()) return 0;
    std::ifstream file(path);
    std::string line;
    int64_t read = 0;
    while (std::getline(file, line)) {
      TuningKey key;
      Choice choice;
      if (!parse_line(line, t.tag, &key, &choice)) continue;
      ++read;
      auto it = t.choices.find(key);
      if (it != t.choices.end() && (it->second.source == Source::kImported || !overwrite)) continue;
      put(t, t.choices, key, choice, Source::kFile);
    }
    return read;
  }

  std::mutex mutex_;
  std::map<int, Tables> tables_;
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
                 "(shape and token-count bucket) once, within a time budget (FUSED_DENSE_TUNING_VERBOSE=1 "
                 "prints each choice, FUSED_DENSE_TUNING=0 turns measuring off)\n");
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

namespace {

// Counts below this are their own representatives on every grid (2^k (1 + j / b) is an integer
// for 2^k >= b; 16 leaves room for b = 8).
constexpr int64_t kExactBelow = 16;

// The bucket grid of the settings, read without copying them (m_bucket runs on every 'auto' call).
int bucket_grid() {
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  initialize_locked(st);
  return st.settings.buckets;
}

// The representatives next to m >= kExactBelow on grid b: lo <= m < hi.
std::pair<int64_t, int64_t> neighbours(int64_t m, int b) {
  int64_t octave = 1;
  while (octave * 2 <= m) octave *= 2;
  const int64_t step = octave / b;
  const int64_t lo = octave + (m - octave) / step * step;
  return {lo, lo + step};
}

}  // namespace

MBucket m_bucket(int64_t m) {
  const int b = bucket_grid();
  if (m < kExactBelow || b == 0) return {m, m, b == 0 ? 0 : b};
  const auto [lo, hi] = neighbours(m, b);
  // nearest by ratio: lo where m / lo <= hi / m (in integers: m * m <= lo * hi, no overflow below 2^31)
  const int64_t rep = (m == lo || static_cast<long double>(m) * m <= static_cast<long double>(lo) * hi) ? lo : hi;
  return {rep, rep, b};
}

std::vector<int64_t> m_representatives(int64_t lo, int64_t hi) {
  const int b = bucket_grid();
  std::vector<int64_t> reps;
  for (int64_t m = std::max<int64_t>(lo, 1); m <= hi && m < kExactBelow; ++m) reps.push_back(m);
  if (b == 0) {
    for (int64_t m = std::max(lo, kExactBelow); m <= hi; ++m) reps.push_back(m);
    return reps;
  }
  for (int64_t octave = kExactBelow; octave <= hi; octave *= 2)
    for (int j = 0; j < b; ++j) {
      const int64_t r = octave + j * (octave / b);
      if (r >= lo && r <= hi) reps.push_back(r);
    }
  return reps;
}

TuningSettings tuning_settings() { return current_settings(); }

void set_tuning_settings(const TuningSettings& settings) {
  if (!valid_bucket_grid(settings.buckets))
    throw Error("fused_dense: tuning buckets must be 0, 1, 2, 4 or 8 per octave, got " +
                std::to_string(settings.buckets));
  if (!(settings.budget_s >= 0.0) || !(settings.problem_budget_ms >= 0.0) || !(settings.pace >= 0.0))
    throw Error("fused_dense: tuning budgets must be >= 0, got budget_s=" + std::to_string(settings.budget_s) +
                ", problem_budget_ms=" + std::to_string(settings.problem_budget_ms) +
                ", pace=" + std::to_string(settings.pace));
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  initialize_locked(st);
  if (settings.cache_path != st.settings.cache_path || settings.table_path != st.settings.table_path)
    ++st.files_generation;
  st.settings = settings;
}

void set_default_tuning_table(const std::string& path) {
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const bool was_default = !st.initialized || (!st.table_from_env && st.settings.table_path == st.default_table);
  st.default_table = path;
  if (st.initialized && was_default && st.settings.table_path != path) {
    st.settings.table_path = path;
    ++st.files_generation;
  }
}

TuningStats tuning_stats() {
  // the choice cache's lock is taken before the state's wherever both are held (tables_for)
  const int64_t process_choices = choice_cache().process_choices();
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  TuningStats stats = st.stats;
  stats.process_choices = process_choices;
  stats.measuring_s = st.spent_s;
  stats.heuristic_queries = gemm_heuristic_queries();
  stats.plans_cached = gemm_plans_cached();
  return stats;
}

namespace {

bool deterministic_setting() {
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  initialize_locked(st);
  return st.settings.deterministic;
}

// Whether a problem may be measured now on this stream: enabled, not capturing a CUDA graph, and
// the process's budget (with its pacing) not spent.
bool may_measure(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  initialize_locked(st);
  if (!st.settings.enabled || st.spent_s >= st.settings.budget_s) return false;
  if (!st.first_measured || st.settings.pace >= 1.0) return true;
  const double since_first =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - *st.first_measured).count();
  return st.spent_s < kInitialAllowanceS + st.settings.pace * since_first;
}

// Keeps `rule` for key without measuring (provisional: measured later when allowed).
void keep_rule_choice(int device, const TuningKey& key, const Choice& rule) {
  choice_cache().insert(device, key, rule, Source::kProvisional);
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  ++st.stats.rule_choices;
}

// Measures the candidates with `run` (which runs them on synthetic operands at the bucket's
// representative M) and caches the best for key: the rule's choice stays unless another beats it
// by kMinGain. Called only when may_measure(stream).
// A buffer of twice the GPU's L2 cache, written before each timed run so that no run finds its
// operands there (null when the arena could not hold it: runs are then timed as they come).
struct L2Flush {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  unsigned salt = 0;
};

L2Flush l2_flush_buffer(int device, TuningArena& arena) {
  int l2 = 0;
  FD_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  L2Flush f;
  f.bytes = 2 * static_cast<std::size_t>(std::max(l2, 1 << 20));
  f.ptr = arena.scratch(f.bytes);
  return f;
}

Choice tune(int device, const TuningKey& key, const std::string& description, const std::vector<Choice>& all,
            int max_plain, const Choice& rule, const CandidateRunner& run, cudaStream_t stream, L2Flush l2_flush) {
  announce_first_tuning();
  const auto t0 = std::chrono::steady_clock::now();
  double problem_budget_ms = 0.0;
  bool warm_gpu = false;
  {
    TunerState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    initialize_locked(st);
    problem_budget_ms = st.settings.problem_budget_ms;
    if (!st.first_measured) st.first_measured = t0;
    warm_gpu = st.last_measured && std::chrono::duration<double>(t0 - *st.last_measured).count() < kWarmGapS;
  }
  auto spent_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  auto charge = [&](bool measured) {
    TunerState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    st.spent_s += spent_ms() / 1000.0;
    st.last_measured = std::chrono::steady_clock::now();
    if (measured) {
      ++st.stats.problems_measured;
    } else {
      ++st.stats.rule_choices;
    }
  };
  // When no candidate applies or runs, the rule's choice is kept for the process (not persisted,
  // and not measured again: another call would find the same), so later calls skip all of this.
  auto give_rule_choice = [&] {
    choice_cache().insert(device, key, rule, Source::kRule, /*persist=*/false);
    charge(false);
    return rule;
  };

  const CandidateKinds kinds = candidate_kinds();
  // The rule's choice first: measured before the problem's budget can run out.
  std::vector<Choice> candidates;
  int fused_taken = 0, plain_taken = 0;
  for (const Choice& c : all) {
    if (c.cutlass >= 0) {
      if (!kinds.cutlass || (kinds.cutlass_config >= 0 && c.cutlass / kCutlassOrders != kinds.cutlass_config)) continue;
    } else if (c.fused) {
      if (!kinds.fused || fused_taken++ >= kMaxFusedCandidates) continue;
    } else {
      if (!kinds.unfused || plain_taken++ >= max_plain) continue;
    }
    if (c == rule) {
      candidates.insert(candidates.begin(), c);
    } else {
      candidates.push_back(c);
    }
  }
  // Nothing of the kinds asked for applies (e.g. cutlass:<c> past a kernel's configurations).
  if (candidates.empty()) return give_rule_choice();

  Event start = make_event(), stop = make_event();
  // One timed batch of `runs` runs of `c` (after an L2 flush where `flush`); negative when it is
  // rejected.
  auto time_ms = [&](const Choice& c, int runs, bool flush) -> float {
    try {
      if (flush && l2_flush.ptr != nullptr)
        FD_CUDA_CHECK(cudaMemsetAsync(l2_flush.ptr, static_cast<int>(l2_flush.salt++ & 0xff), l2_flush.bytes, stream));
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
  // Run the first accepted candidate (the rule's choice where it is one) for kWarmupMs before
  // timing anything, unless the GPU measured something a moment ago.
  Choice warm = candidates.front();
  float warm_ms = time_ms(warm, 1, false);
  for (std::size_t i = 1; warm_ms < 0.f && i < candidates.size(); ++i) warm_ms = time_ms(warm = candidates[i], 1, false);
  // Every candidate rejected at launch: measuring again would not change that.
  if (warm_ms < 0.f) return give_rule_choice();
  if (!warm_gpu) {
    const int warm_runs = std::clamp(static_cast<int>(kWarmupMs / std::max(warm_ms, 1e-3f)), 0, kMaxWarmupRuns);
    if (warm_runs > 0) time_ms(warm, warm_runs, false);
  }
  // Long or not, from a run of the warmed candidate: the first run may include loading its kernel.
  const float run_ms = time_ms(warm, 1, false);
  const int lead_in_runs = run_ms >= kSustainAboveMs ? static_cast<int>(std::ceil(kLeadInMs / run_ms)) : 0;
  // One measurement of `c`: one run after an L2 flush, or after its lead-in where it has one.
  auto measure_ms = [&](const Choice& c) -> float {
    if (lead_in_runs == 0) return time_ms(c, 1, true);
    if (time_ms(c, lead_in_runs, false) < 0.f) return -1.f;
    return time_ms(c, 1, false);
  };

  // Rounds over all candidates, one measurement each (measure_ms): a transient
  // slowdown (another process, a clock dip) then moves one run of a candidate, not the decision,
  // which takes each candidate's median. Once the problem's budget is spent, what has been
  // measured decides (the first two candidates always are).
  const std::size_t n = candidates.size();
  std::vector<std::vector<float>> runs_of(n);
  std::vector<bool> rejected(n, false), dropped(n, false);
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5f * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  // spread of a candidate's runs: their range, less the one slowest run once there are 4 or more
  auto spread = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    if (v.size() >= 4) v.pop_back();
    return v.back() - v.front();
  };
  int rounds = 0;
  bool out_of_budget = false, settled = false;
  for (; rounds < kMaxRounds && !out_of_budget && !settled; ++rounds) {
    // Each round starts one candidate later: no candidate always follows the same one (the one
    // before sets the clock and power state it starts in), and the first round keeps the rule's
    // choice first.
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = (j + static_cast<std::size_t>(rounds)) % n;
      if (rejected[i] || dropped[i]) continue;
      if ((rounds > 0 || j >= 2) && spent_ms() > problem_budget_ms) {
        out_of_budget = true;
        break;
      }
      const float ms = measure_ms(candidates[i]);
      if (ms < 0.f) {
        rejected[i] = true;
        continue;
      }
      runs_of[i].push_back(ms);
    }
    if (rounds + 1 < kMinRounds || out_of_budget) continue;
    // winner and runner-up by median; stop once the margin between them exceeds both spreads
    std::size_t w = n, u = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (rejected[i] || runs_of[i].empty()) continue;
      if (w == n || median(runs_of[i]) < median(runs_of[w])) {
        u = w;
        w = i;
      } else if (u == n || median(runs_of[i]) < median(runs_of[u])) {
        u = i;
      }
    }
    if (w == n || u == n) {
      settled = true;
      continue;
    }
    const float winner = median(runs_of[w]);
    settled = median(runs_of[u]) - winner > std::max(spread(runs_of[w]), spread(runs_of[u]));
    for (std::size_t i = 0; i < n; ++i)
      if (i != w && !runs_of[i].empty() &&
          *std::min_element(runs_of[i].begin(), runs_of[i].end()) >= kDropAbove * winner)
        dropped[i] = true;
  }
  std::vector<float> best_of(n, std::numeric_limits<float>::infinity());
  for (std::size_t i = 0; i < n; ++i)
    if (!rejected[i] && !runs_of[i].empty()) best_of[i] = median(runs_of[i]);
  Choice best = rule;
  float best_ms = std::numeric_limits<float>::infinity();
  float rule_ms = std::numeric_limits<float>::quiet_NaN();
  int measured = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (rejected[i] || !(best_of[i] < std::numeric_limits<float>::infinity())) continue;
    ++measured;
    const Choice& c = candidates[i];
    if (c == rule) rule_ms = best_of[i];
    if (best_of[i] < best_ms) {
      best_ms = best_of[i];
      best = c;
    }
  }
  // The rule's choice stays unless another beats it clearly: a 1% difference is within what
  // repeating the measurement moves, and a switch on noise is a loss as likely as a gain.
  if (!std::isnan(rule_ms) && best_ms > rule_ms * (1.0f - kMinGain)) {
    best = rule;
    best_ms = rule_ms;
  }
  if (measured == 0) return give_rule_choice();
  const char* verbose = std::getenv("FUSED_DENSE_TUNING_VERBOSE");
  if (verbose != nullptr && *verbose != '\0' && std::string(verbose) != "0") {
    std::fprintf(stderr,
                 "fused_dense: tuned %s: %s %d%s, %.4f ms (rule's choice: %.4f ms), %d candidates, %d "
                 "rounds%s, %.1f ms\n",
                 description.c_str(), choice_kind(best), best.cutlass >= 0 ? best.cutlass : best.algorithm,
                 cutlass_variant_detail(best).c_str(), best_ms, rule_ms, measured, rounds,
                 lead_in_runs > 0 ? (", each run after " + std::to_string(lead_in_runs) + " of its own").c_str() : "",
                 spent_ms());
    if (std::string(verbose) == "2")  // every candidate's best batch, for probing the variants
      for (std::size_t i = 0; i < candidates.size(); ++i)
        std::fprintf(stderr, "fused_dense:   candidate %s %d%s: %.4f ms\n", choice_kind(candidates[i]),
                     candidates[i].cutlass >= 0 ? candidates[i].cutlass : candidates[i].algorithm,
                     cutlass_variant_detail(candidates[i]).c_str(), rejected[i] ? -1.f : best_of[i]);
  }
  choice_cache().insert(device, key, best, Source::kMeasured);
  charge(true);
  return best;
}

}  // namespace

Choice choose(int device, cudaStream_t stream, const TuningKey& key, bool fixed, FunctionRef<Choice()> rule,
              FunctionRef<std::optional<TuningTrial>(TuningArena&)> trial) {
  // Once the key has a choice, this lookup is the per-call cost of 'auto' (and, at a new M, one
  // cublasLtMatmulAlgoCheck per algorithm in gemm.h).
  fixed = fixed || deterministic_setting();
  Choice choice;
  const CachedKind cached = choice_cache().lookup(device, key, fixed, &choice);
  if (cached == CachedKind::kFinal || (cached == CachedKind::kProvisional && !may_measure(stream))) return choice;
  const Choice rule_choice = rule();
  if (fixed) {
    choice_cache().insert_fixed_rule(device, key, rule_choice);
    return rule_choice;
  }
  if (may_measure(stream)) {
    TuningArena arena(stream);
    if (const std::optional<TuningTrial> t = trial(arena))  // the flush buffer after the operands:
      return tune(device, key, t->description, t->candidates, t->max_plain, rule_choice, t->run, stream,
                  l2_flush_buffer(device, arena));  // without room for it, runs are timed unflushed
  }
  keep_rule_choice(device, key, rule_choice);
  return rule_choice;
}

bool key_exact_m(int device, cudaStream_t stream, const TuningKey& exact_key, bool fixed) {
  {
    TunerState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    initialize_locked(st);
    if (!st.settings.refine) return false;
    fixed = fixed || st.settings.deterministic;
  }
  // In deterministic mode lookup() returns only choices from files and imports: a process that
  // imports another's choices (measure_and_share) runs that process's exact-M choices.
  Choice choice;
  if (choice_cache().lookup(device, exact_key, fixed, &choice) == CachedKind::kFinal) return true;
  return !fixed && may_measure(stream);
}

std::vector<std::string> export_choices(int device) { return choice_cache().export_lines(device); }

int64_t import_choices(int device, const std::vector<std::string>& lines) {
  const int64_t taken = choice_cache().import_lines(device, lines);
  TunerState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.stats.imported_choices += taken;
  return taken;
}

}  // namespace fused_dense::core
