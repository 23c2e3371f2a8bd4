// The tuner's settings, statistics and M buckets (csrc/core/tuning/tuner.h), for fused_dense/tuning.py.
// CUDA builds only: a CPU-only build has no tuner, and tuning.py says so.
#include <torch/library.h>

#include <string>
#include <tuple>

#include "core/tuning/tuner.h"
#include "core/common/types.h"

namespace fused_dense {
namespace {

using Settings = std::tuple<bool, double, double, double, int64_t, std::string, std::string>;

// Core errors (a bad budget) reach Python as RuntimeError with the core's message.
template <class Fn>
auto translated(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const core::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

Settings get_settings() {
  return translated([] {
    const core::TuningSettings s = core::tuning_settings();
    return Settings{s.enabled, s.budget_s, s.problem_budget_ms, s.pace, s.buckets, s.cache_path, s.table_path};
  });
}

void set_settings(bool enabled, double budget_s, double problem_budget_ms, double pace, int64_t buckets, const std::string& cache,
                  const std::string& table) {
  translated([&] {
    core::TuningSettings s;
    s.enabled = enabled;
    s.budget_s = budget_s;
    s.problem_budget_ms = problem_budget_ms;
    s.pace = pace;
    s.buckets = static_cast<int>(buckets);
    s.cache_path = cache;
    s.table_path = table;
    core::set_tuning_settings(s);
    return 0;
  });
}

std::tuple<int64_t, int64_t, int64_t, int64_t, double, int64_t> stats() {
  const core::TuningStats s = core::tuning_stats();
  return {s.problems_measured, s.rule_choices, s.table_choices, s.cache_choices, s.measuring_s, s.heuristic_queries};
}

std::tuple<int64_t, int64_t> bucket(int64_t m) {
  TORCH_CHECK(m >= 1, "fused_dense::tuning_m_bucket: m must be >= 1, got ", m);
  const core::MBucket b = translated([&] { return core::m_bucket(m); });
  return {b.index, b.representative};
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("tuning_settings() -> (bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table)",
        &fused_dense::get_settings);
  m.def("set_tuning_settings(bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table) -> ()",
        &fused_dense::set_settings);
  m.def("set_default_tuning_table(str path) -> ()",
        [](const std::string& path) { fused_dense::core::set_default_tuning_table(path); });
  m.def("tuning_stats() -> (int problems_measured, int rule_choices, int table_choices, int cache_choices, "
        "float measuring_s, int heuristic_queries)",
        &fused_dense::stats);
  m.def("tuning_m_bucket(int m) -> (int index, int representative)", &fused_dense::bucket);
}
