#pragma once

#include <ATen/core/Tensor.h>

namespace mfsdp2 {

// FP8 all-gather's quantisation: for each segment s of the flat float32 tensor ``src``,
// dst[i] = float8(clamp(src[i] * scales[s], -max, max)) as raw bytes into the uint8 tensor
// ``dst`` (float8 rounding to nearest, ties to even: the bits torch's .to(float8) gives for the
// clamped value); every position of ``dst`` outside the segments is set to 0. ``e5m2`` selects
// float8_e5m2, otherwise float8_e4m3fn. One pass over the buffer.
void quantise_fp8(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& offsets,
                  const at::Tensor& lengths, const at::Tensor& scales, double max, bool e5m2);

// dst[i] = tables[s][src[i]] for each segment s (disjoint): a byte -> value lookup with one
// 256-entry table per segment, tables and dst of one 2- or 4-byte dtype. Dequantising float8
// bytes is this lookup with tables[s][b] = (float8 b as float32) / scales[s] in the compute
// dtype, which the caller builds with torch (so the values are torch's by construction).
// ``allow_vbmi``: 2-byte outputs use the AVX-512 VBMI byte-permute path where the CPU has it
// (tests turn it off to check the other path on such CPUs).
void lookup_bytes(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& offsets,
                  const at::Tensor& lengths, const at::Tensor& tables, bool allow_vbmi);

// Whether this CPU runs lookup_bytes' AVX-512 VBMI path.
bool has_vbmi();

}  // namespace mfsdp2
