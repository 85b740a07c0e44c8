#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace mfsdp2 {

// For each segment s of the flat 1-D float32 / bfloat16 tensor ``x``: the sum of squares of
// x[offsets[s] : offsets[s] + lengths[s]] in float64, and whether any of those values is
// non-finite.
std::tuple<at::Tensor, at::Tensor> segment_sumsq(const at::Tensor& x, const at::Tensor& offsets,
                                                 const at::Tensor& lengths);

// For each segment of the flat float32 tensor ``x``: max |x| over it (NaN if it holds a NaN,
// 0 if it is empty).
at::Tensor segment_amax(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& lengths);

}  // namespace mfsdp2
