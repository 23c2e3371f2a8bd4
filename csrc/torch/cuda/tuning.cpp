// The tuning family's kernels (tuning.cpp has the schemas): the tuner's settings, statistics and
// M buckets (csrc/core/tuning/tuner.h). CUDA builds only: a CPU-only build has no tuner, and
// fused_dense/tuning.py says so before calling these ops.
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "core/tuning/tuner.h"
#include "core/common/types.h"

namespace fused_dense {
namespace {

using Settings = std::tuple<bool, double, double, double, int64_t, std::string, std::string, bool, bool>;

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
    return Settings{s.enabled, s.budget_s, s.problem_budget_ms, s.pace, s.buckets, s.cache_path, s.table_path,
                    s.deterministic, s.refine};
  });
}

void set_settings(bool enabled, double budget_s, double problem_budget_ms, double pace, int64_t buckets, const std::string& cache,
                  const std::string& table, bool deterministic, bool refine) {
  translated([&] {
    core::TuningSettings s;
    s.enabled = enabled;
    s.budget_s = budget_s;
    s.problem_budget_ms = problem_budget_ms;
    s.pace = pace;
    s.buckets = static_cast<int>(buckets);
    s.cache_path = cache;
    s.table_path = table;
    s.deterministic = deterministic;
    s.refine = refine;
    core::set_tuning_settings(s);
    return 0;
  });
}

std::tuple<int64_t, int64_t, int64_t, int64_t, double, int64_t, int64_t, int64_t, int64_t> stats() {
  const core::TuningStats s = core::tuning_stats();
  return {s.problems_measured, s.rule_choices,      s.table_choices,   s.cache_choices, s.measuring_s,
          s.heuristic_queries, s.imported_choices, s.process_choices, s.plans_cached};
}

std::vector<int64_t> representatives(int64_t lo, int64_t hi) {
  TORCH_CHECK_VALUE(lo >= 1 && lo <= hi, "fused_dense::tuning_representatives: need 1 <= lo <= hi, got lo=", lo,
                    ", hi=", hi);
  return translated([&] { return core::m_representatives(lo, hi); });
}

void check_device(const char* op, int64_t device) {
  int count = 0;
  TORCH_CHECK(cudaGetDeviceCount(&count) == cudaSuccess, op, ": no CUDA device");
  TORCH_CHECK_VALUE(device >= 0 && device < count, op, ": device must be in [0, ", count, "), got ", device);
}

std::vector<std::string> export_choices(int64_t device) {
  check_device("fused_dense::tuning_export_choices", device);
  return translated([&] { return core::export_choices(static_cast<int>(device)); });
}

int64_t import_choices(int64_t device, const std::vector<std::string>& lines) {
  check_device("fused_dense::tuning_import_choices", device);
  return translated([&] { return core::import_choices(static_cast<int>(device), lines); });
}

std::tuple<int64_t, int64_t> bucket(int64_t m) {
  TORCH_CHECK_VALUE(m >= 1, "fused_dense::tuning_m_bucket: m must be >= 1, got ", m);
  const core::MBucket b = translated([&] { return core::m_bucket(m); });
  return {b.index, b.representative};
}

}  // namespace
}  // namespace fused_dense

// Tensor-free ops: the CompositeImplicitAutograd kernel is the one a call without tensors reaches.
TORCH_LIBRARY_IMPL(fused_dense, CompositeImplicitAutograd, m) {
  m.impl("tuning_settings", &fused_dense::get_settings);
  m.impl("set_tuning_settings", &fused_dense::set_settings);
  m.impl("set_default_tuning_table", [](const std::string& path) { fused_dense::core::set_default_tuning_table(path); });
  m.impl("tuning_stats", &fused_dense::stats);
  m.impl("tuning_m_bucket", &fused_dense::bucket);
  m.impl("tuning_representatives", &fused_dense::representatives);
  m.impl("tuning_export_choices", &fused_dense::export_choices);
  m.impl("tuning_import_choices", &fused_dense::import_choices);
}
