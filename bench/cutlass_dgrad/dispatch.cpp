#include "act_dgrad_sm90.h"

namespace fused_dense_probe {

#define DECLARE(ID)                                                                  \
  size_t config_##ID##_workspace(const ActDgradProblem&, std::string*);              \
  std::string config_##ID##_run(const ActDgradProblem&, void*, size_t, int, cudaStream_t);
DECLARE(0)
DECLARE(1)
DECLARE(2)
#undef DECLARE

const char* config_name(int config) {
  switch (config) {
    case 0: return "128x128 cluster 2x1 pingpong";
    case 1: return "128x256 cluster 2x1 cooperative";
    case 2: return "256x128 cluster 1x2 cooperative";
    default: return nullptr;
  }
}

size_t act_dgrad_workspace_bytes(int config, const ActDgradProblem& p, std::string* error) {
  switch (config) {
    case 0: return config_0_workspace(p, error);
    case 1: return config_1_workspace(p, error);
    case 2: return config_2_workspace(p, error);
    default: *error = "config out of range"; return 0;
  }
}

std::string act_dgrad(int config, const ActDgradProblem& p, void* ws, size_t bytes, int sms, cudaStream_t s) {
  switch (config) {
    case 0: return config_0_run(p, ws, bytes, sms, s);
    case 1: return config_1_run(p, ws, bytes, sms, s);
    case 2: return config_2_run(p, ws, bytes, sms, s);
    default: return "config out of range";
  }
}

}  // namespace fused_dense_probe
