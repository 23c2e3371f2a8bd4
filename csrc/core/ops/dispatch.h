// The dispatch of an op's heuristic argument onto its GEMM choices, shared by the ops of linear.h,
// gated.h and fp8_linear.h: each op describes its problem as an OpSetup (the GEMM problems and a
// runner of any choice) and dispatch() resolves an explicit index or asks the tuner (tuner.h) once
// for 'auto'.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "core/gemm/gemm.h"
#include "core/ops/linear.h"
#include "core/tuning/tuner.h"
#include "core/tuning/tuning_arena.h"

namespace fused_dense::core::dispatch_detail {

// The op of a tuning key. The three FP8 kinds are fp8_linear's GEMM by its operands' formats
// (input x weight): e4m3 x e4m3 (forward), e5m2 x e4m3 (a gradient times a weight or an input),
// e4m3 x e5m2. Codes are written in the cache file's lines: keep them stable.
enum class OpKind : int64_t {
  kForward = 0,
  kWgrad = 1,
  kDgrad = 2,
  kGatedForward = 3,
  kGatedDgrad = 4,
  kFp8E4M3xE4M3 = 5,
  kFp8E5M2xE4M3 = 6,
  kFp8E4M3xE5M2 = 7,
};

inline TuningKey tuning_key(OpKind op, const LinearContext& ctx, const MBucket& bucket, int64_t K, int64_t N,
                            Activation act, bool flag_a, bool flag_b) {
  TuningKey key;
  // the last slot: the bucket grid (TuningSettings::buckets; 0 for exact-M keys)
  key.v = {static_cast<int64_t>(op), static_cast<int64_t>(ctx.dtype), bucket.index, K, N, static_cast<int64_t>(act),
           flag_a, flag_b, ctx.dtype == DType::kFloat32 && ctx.allow_tf32,
           bucket.per_octave};
  return key;
}

inline std::string describe(const char* op, const LinearContext& ctx, int64_t B, int64_t K, int64_t N, Activation act) {
  std::ostringstream s;
  s << op << " " << dtype_name(ctx.dtype) << " " << activation_name(act) << " B=" << B << " K=" << K << " N=" << N;
  return s.str();
}

inline bool aligned256(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 256 == 0; }

// One op's problem, as the dispatch sees it: the two GEMM problems (fused epilogue, plain) and, in
// OpSetup, a runner of any choice on the setup's own pointers. Built from (context, arguments) by
// one function per op: once for the call and, where the tuner asks (choose, tuner.h), once at the
// bucket's representative M for the rule's choice and once more on synthetic operands there to
// measure.
struct OpProblems {
  GemmProblem fused, plain;
  bool fused_possible = false;
  // A, B and D 256-byte aligned, as the stored algorithms' lists assumed (gemm.h): otherwise a
  // choice runs with cuBLASLt's first algorithm for this call's problem and alignment instead.
  bool aligned = true;
  int max_plain = TuningTrial{}.max_plain;  // plain algorithms measured (TuningTrial::max_plain)
};

struct NoCutlassVariants {
  int operator()() const { return 0; }
};

// The runner and the count of cutlass_sm90 variants are the op's own lambdas, held by value: a
// call builds its setup on the stack, with no std::function (whose captures, the op's arguments,
// would not fit its small buffer: a heap allocation per GEMM call). Only a measurement wraps the
// runner in the tuner's CandidateRunner.
template <class Runner, class Variants>
struct OpSetup : OpProblems {
  Runner run;
  Variants cutlass_variants;
};

template <class Runner, class Variants = NoCutlassVariants>
OpSetup<Runner, Variants> op_setup(const OpProblems& problems, Runner run, Variants variants = {}) {
  return {problems, std::move(run), std::move(variants)};
}

// The cuBLASLt GEMM of a choice: its stored algorithm ('auto') or its index (an explicit heuristic).
inline bool run_gemm(const GemmProblem& p, const GemmPointers& ptrs, const Choice& c, const Workspace& ws,
                     cudaStream_t stream) {
  return c.has_algo ? try_gemm_algorithm(p, ptrs, c.algo, ws, stream) : try_gemm(p, ptrs, c.algorithm, ws, stream);
}

// Resolves the heuristic argument into runs of the setup's runner: an explicit index tries the
// fused epilogue and, where cuBLASLt refuses it, the unfused path with the same index into the
// plain list; 'auto' asks the tuner once (choose, tuner.h) for the bucket's choice, handing it the
// rule's choice at the representative M and, to measure, this op's candidates on synthetic
// operands there.
//   make_setup(ctx, args) -> an OpSetup (op_setup);  synthetic(args, M, arena) -> args at M on arena buffers;
//   workspace_bytes(device, args) -> the workspace those need.
template <class Args, class MakeSetup, class Synthetic, class WorkspaceBytes>
void dispatch(int heuristic, const Choice& rule_kind, const LinearContext& ctx, const Args& args, OpKind op,
              int64_t K, int64_t N, Activation act, bool flag_a, bool flag_b, const char* name, MakeSetup&& make_setup,
              Synthetic&& synthetic, WorkspaceBytes&& workspace_bytes) {
  const auto setup = make_setup(ctx, args);
  if (heuristic == kHeuristicUnfused || (heuristic >= 0 && !setup.fused_possible)) {
    if (!setup.run(Choice{false, std::max(heuristic, 0)}))
      throw Error("fused_dense: cuBLASLt offers no algorithm for the " + std::string(name) + " GEMM");
    return;
  }
  if (heuristic >= 0) {
    if (!setup.run(Choice{true, heuristic}) && !setup.run(Choice{false, heuristic}))
      throw Error("fused_dense: cuBLASLt offers no algorithm for the " + std::string(name) + " GEMM");
    return;
  }
  MBucket bucket = m_bucket(args.batch);
  if (bucket.representative != args.batch) {  // no representative: its exact M where key_exact_m says
    const MBucket exact{args.batch, args.batch, 0};
    if (key_exact_m(ctx.device, ctx.stream, tuning_key(op, ctx, exact, K, N, act, flag_a, flag_b), ctx.deterministic))
      bucket = exact;
  }
  // The rule's choice at the representative M, with cuBLASLt's first algorithm there.
  const auto rule = [&] {
    Args at_rep = args;
    at_rep.batch = bucket.representative;
    const auto rep = make_setup(ctx, at_rep);
    Choice c = rule_kind;
    if (c.fused && !(rep.fused_possible && gemm_algorithm(rep.fused, 0, &c.algo))) c = Choice{false, 0};
    if (!c.fused) c.has_algo = gemm_algorithm(rep.plain, 0, &c.algo);
    else c.has_algo = true;
    return c;
  };
  // The candidates at the representative M, on synthetic operands and workspace from the arena.
  const auto trial = [&](TuningArena& arena) -> std::optional<TuningTrial> {
    LinearContext tctx = ctx;
    const Args t_args = synthetic(args, bucket.representative, arena);
    const std::size_t ws_bytes = workspace_bytes(ctx.device, t_args);
    tctx.workspace = Workspace{arena.scratch(ws_bytes), ws_bytes};
    if (!arena.ok()) return std::nullopt;
    auto t = make_setup(tctx, t_args);
    TuningTrial out;
    cublasLtMatmulAlgo_t algo;
    for (int i = 0; t.fused_possible && gemm_algorithm(t.fused, i, &algo); ++i)
      out.candidates.push_back(Choice{true, i, -1, true, algo});
    for (int i = 0; gemm_algorithm(t.plain, i, &algo); ++i) out.candidates.push_back(Choice{false, i, -1, true, algo});
    for (int i = 0, n = t.cutlass_variants(); i < n; ++i) out.candidates.push_back(Choice{false, 0, i});
    out.run = std::move(t.run);
    out.max_plain = t.max_plain;
    out.description = describe(name, ctx, bucket.representative, K, N, act);
    return out;
  };
  Choice choice = choose(ctx.device, ctx.stream, tuning_key(op, ctx, bucket, K, N, act, flag_a, flag_b),
                         ctx.deterministic, rule, trial);
  if (!setup.aligned && choice.has_algo) {
    choice.has_algo = false;
    choice.algorithm = 0;
  }
  // A stored algorithm that does not serve this M (or these operands), or a cutlass_sm90 variant
  // whose operand rules this call breaks: cuBLASLt's first plain algorithm for the exact problem.
  bool done = false;
  try {
    done = setup.run(choice);
  } catch (const HeuristicOutOfRange&) {
  }
  if (!done && !setup.run(Choice{false, 0}))
    throw Error("fused_dense: cuBLASLt offers no algorithm for the " + std::string(name) + " GEMM");
}

}  // namespace fused_dense::core::dispatch_detail
