#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace mfsdp2 {

// adamw_step (adamw.h) with float32 params / grads and bfloat16 exp_avgs / exp_avg_sqs /
// max_exp_avg_sqs, stored by stochastic rounding, and an IEEE square root (see adamw_bf16.cpp). ``segments``: int64
// [n, 7] rows (flat, offset, length, hyper row, step slot, parameter id, element): the last two
// key the random bits -- the parameter's id in the optimizer and the index, within the whole
// parameter, of the segment's first element. ``steps`` are float32. ``seed`` salts every hash.
void adamw_step_bf16(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                     const at::Tensor& segments, const at::Tensor& hyper, int64_t seed, bool fma_lerp,
                     bool fma_addcmul);

// The hash salt of one parameter's step: h32(h32(h32(step) ^ param_id) ^ seed) on 32-bit values.
uint32_t bf16_salt(int64_t seed, int64_t param_id, double step);

}  // namespace mfsdp2
