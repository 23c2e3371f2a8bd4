// The tuning family: the tuner's settings, statistics and M buckets (csrc/core/tuning/tuner.h),
// for fused_dense/tuning.py. The schemas are in every build; the kernels (cuda/tuning.cpp) only in
// a CUDA build, which alone has a tuner.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("tuning_settings() -> (bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table)");
  m.def("set_tuning_settings(bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table) -> ()");
  m.def("set_default_tuning_table(str path) -> ()");
  m.def("tuning_stats() -> (int problems_measured, int rule_choices, int table_choices, int cache_choices, "
        "float measuring_s, int heuristic_queries)");
  m.def("tuning_m_bucket(int m) -> (int index, int representative)");
}
