// The tuning family: the tuner's settings, statistics and M buckets (csrc/core/tuning/tuner.h),
// for fused_dense/tuning.py. The schemas are in every build; the kernels (cuda/tuning.cpp) only in
// a CUDA build, which alone has a tuner.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("tuning_settings() -> (bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table, bool deterministic, bool refine)");
  m.def("set_tuning_settings(bool enabled, float budget_s, float problem_budget_ms, float pace, int buckets, "
        "str cache, str table, bool deterministic, bool refine) -> ()");
  m.def("set_default_tuning_table(str path) -> ()");
  m.def("tuning_stats() -> (int problems_measured, int rule_choices, int table_choices, int cache_choices, "
        "float measuring_s, int heuristic_queries, int imported_choices, int process_choices, int plans_cached)");
  m.def("tuning_m_bucket(int m) -> (int index, int representative)");
  // The representatives of the current grid in [lo, hi] (the token counts a table is measured at).
  m.def("tuning_representatives(int lo, int hi) -> int[]");
  // The device's final choices as lines of the cache file's format, and taking another process's.
  m.def("tuning_export_choices(int device) -> str[]");
  m.def("tuning_import_choices(int device, str[] lines) -> int");
}
