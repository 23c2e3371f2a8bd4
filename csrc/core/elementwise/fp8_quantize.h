// The FP8 quantize pass (compute capability 8.9 and up). Per-tensor scaling: a tensor v is stored
// as q = saturate(v * scale) in an FP8 format, and a GEMM of two such tensors multiplies its fp32
// accumulator by scale_inv_a * scale_inv_b. With current scaling the scale comes from the
// tensor's own amax (fp8_scale_from_amax), with delayed scaling the caller passes it (from an amax
// history) and the pass records the amax for the next scale.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common/types.h"

namespace fused_dense::core {

// The quantize pass, writing a tensor [rows, cols] (cols a multiple of 8, every pointer 16-byte
// aligned; inputs row-major, contiguous, in dtype). The value quantized is
//   v = input                          activation kNone, pre_act null
//   v = act(input)                     backward false: input [rows, cols] is a pre-activation
//   v = input * act'(pre_act)          backward true: input and pre_act [rows, cols], input the
//                                      gradient at act's output
// and for the gated activations (kSwiGLU, kGeGLU; the packed layout of types.h):
//   v = act(g) * u                     backward false: input is the packed gu [rows, 2 cols]
//   v = (d_h * u * act'(g), d_h * act(g)) in gu's layout
//                                      backward true: input is d_h [rows, cols / 2], pre_act the
//                                      packed gu [rows, cols]; cols a multiple of 16
// In the two backward forms pre_act may be kept in e4m3 (pre_scale_inv set): each of its bytes is
// then read as p = round_dtype(e4m3 value * *pre_scale_inv), the pre-activation dequantized and
// rounded to dtype, the bits an ATen dequantization of the same bytes gives.
// with fp32 math (the activation math of activation_math.cuh). Outputs, each where non-null:
//   data [rows, cols] and data_t [cols, ld_t] (ld_t = fp8_padded_rows(rows); the padding
//   columns are zeros): q = saturate(v * scale) in `format`, round to nearest even; NaN stays NaN;
//   scale_out, scale_inv_out, amax_out: one float each (amax = max |v|, NaN if any v is NaN);
//   column_sums [cols] in dtype: sum over rows of v (fp32 accumulation, in a fixed order).
// In place: data may be pre_act itself when pre_act is e4m3 (pre_scale_inv set) and data_t is
// null; each element's bytes are read before its quantized value is written there (the gated
// backward's two halves of an interleave block by lanes of one warp, ordered by a warp barrier).
// No other output may overlap an input.
// scale null: current scaling (a first pass computes the amax, the scale follows from it; with
// known_amax set, that amax of v, recorded by the GEMM that wrote the input, and no first pass);
// else delayed scaling with *scale, the amax recorded in the same single pass.
// input_scale_inv_out set (forward with an activation only): the input's own e4m3 copy as well,
// into input_data [rows, input cols] (cols; gated: 2 cols; null only when rows is 0), at the
// input's own amax (current scaling), and its scale_inv in *input_scale_inv_out: the bytes of this pass run on the input with activation kNone, e4m3 and
// current scaling. Its amax joins v's amax pass (or input_known_amax, recorded by the GEMM that
// wrote the input), its cast v's cast pass, so the copy costs one write of it and no read.
struct Fp8QuantizeArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, cols = 0;  // of the quantized tensor
  const void* input = nullptr;
  const void* pre_act = nullptr;
  const float* pre_scale_inv = nullptr;  // backward only: pre_act is e4m3 bytes with this scale_inv
  Activation activation = Activation::kNone;
  bool backward = false;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  const float* known_amax = nullptr;  // current scaling only
  uint8_t* data = nullptr;
  uint8_t* data_t = nullptr;
  float* scale_out = nullptr;
  float* scale_inv_out = nullptr;
  float* amax_out = nullptr;
  void* column_sums = nullptr;
  uint8_t* input_data = nullptr;
  float* input_scale_inv_out = nullptr;     // set: the copy is made
  const float* input_known_amax = nullptr;  // with the copy only
};

std::size_t fp8_quantize_workspace_bytes(int device, const Fp8QuantizeArgs& args);
// The transposed copy of FP8 bytes data [rows, cols] (row-major, cols a multiple of 16, both
// pointers 16-byte aligned): data_t [cols, fp8_padded_rows(rows)], the padding columns zeros, the
// bytes the quantize pass writes to data_t for the same values. With per-tensor scaling the
// transposed copy of a quantized tensor is this byte transpose, so a caller can free the tensor's
// high-precision source after the row-major pass and make data_t from data.
void fp8_transpose(const uint8_t* data, int64_t rows, int64_t cols, uint8_t* data_t, cudaStream_t stream);
// The scale outputs the quantize pass writes with delayed scaling, without the pass: *scale_out =
// *scale and *scale_inv_out = 1 / *scale, the same bits (for a GEMM that quantized in its epilogue).
void fp8_write_scales(const float* scale, float* scale_out, float* scale_inv_out, cudaStream_t stream);
// The scales of current scaling from a tensor's amax, without the pass: *scale_out =
// fp8_scale_from_amax(*amax, format) and *scale_inv_out = 1 / that, the bits the quantize pass
// writes for a tensor of that amax (for a quantization written in PyTorch ops: fused_dense.fp8's
// traced_quantize under torch.compile, whose own divisions Inductor may round otherwise).
void fp8_scales_of_amax(const float* amax, Fp8Format format, float* scale_out, float* scale_inv_out,
                        cudaStream_t stream);
void fp8_quantize(const Fp8QuantizeArgs& args, void* workspace, std::size_t workspace_bytes, int device,
                  cudaStream_t stream);

}  // namespace fused_dense::core
