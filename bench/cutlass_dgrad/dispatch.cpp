#include "act_dgrad_sm90.h"

namespace fused_dense_probe {

#define DECLARE(ID)                                                                  \
  size_t config_##ID##_workspace(const ActDgradProblem&, const Schedule&, std::string*);              \
  std::string config_##ID##_run(const ActDgradProblem&, const Schedule&, void*, size_t, int, cudaStream_t);
DECLARE(0)
DECLARE(1)
DECLARE(2)
DECLARE(3)
DECLARE(4)
DECLARE(5)
DECLARE(6)
#undef DECLARE

const char* config_name(int config) {
  switch (config) {
    case 0: return "128x128 cluster 2x1 pingpong";
    case 1: return "128x256 cluster 2x1 cooperative";
    case 2: return "256x128 cluster 1x2 cooperative";
    case 3: return "128x256 cluster 2x1 cooperative, plain epilogue (not fused)";
    case 4: return "256x128 cluster 2x1 cooperative";
    case 5: return "128x256 cluster 2x1 cooperative, GELU backward only (no bias)";
    case 6: return "128x128 cluster 2x1 pingpong, GELU backward only (no bias)";
    default: return nullptr;
  }
}

size_t act_dgrad_workspace_bytes(int config, const ActDgradProblem& p, const Schedule& sc, std::string* error) {
  switch (config) {
    case 0: return config_0_workspace(p, sc, error);
    case 1: return config_1_workspace(p, sc, error);
    case 2: return config_2_workspace(p, sc, error);
    case 3: return config_3_workspace(p, sc, error);
    case 4: return config_4_workspace(p, sc, error);
    case 5: return config_5_workspace(p, sc, error);
    case 6: return config_6_workspace(p, sc, error);
    default: *error = "config out of range"; return 0;
  }
}

std::string act_dgrad(int config, const ActDgradProblem& p, const Schedule& sc, void* ws, size_t bytes, int sms,
                      cudaStream_t s) {
  switch (config) {
    case 0: return config_0_run(p, sc, ws, bytes, sms, s);
    case 1: return config_1_run(p, sc, ws, bytes, sms, s);
    case 2: return config_2_run(p, sc, ws, bytes, sms, s);
    case 3: return config_3_run(p, sc, ws, bytes, sms, s);
    case 4: return config_4_run(p, sc, ws, bytes, sms, s);
    case 5: return config_5_run(p, sc, ws, bytes, sms, s);
    case 6: return config_6_run(p, sc, ws, bytes, sms, s);
    default: return "config out of range";
  }
}

}  // namespace fused_dense_probe
