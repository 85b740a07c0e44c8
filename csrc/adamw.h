#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace mfsdp2 {

// torch AdamW's step (decoupled weight decay, the for-loop / foreach arithmetic of
// torch.optim.AdamW, non-capturable) on segments of flat tensors, in place.
//
// ``params[f]``, ``grads[f]``, ``exp_avgs[f]``, ``exp_avg_sqs[f]`` (and ``max_exp_avg_sqs[f]``
// where a segment of flat ``f`` uses amsgrad; an empty tensor otherwise) are contiguous 1-D CPU
// tensors of one floating dtype (float32 or float64) and one length per flat ``f``. ``steps[f]``
// is a contiguous 1-D float32 (or float64) CPU tensor of step counters (one per parameter).
//
// ``segments``: int64 [n, 5] rows (flat, offset, length, hyper row, step slot), one per parameter
// piece; non-empty segments of one flat must be disjoint. Every row first adds 1 to
// steps[flat][slot] (empty pieces too: torch counts their steps), then its elements are stepped
// with the hyper-parameters hyper[row] = (lr, beta1, beta2, eps, weight_decay, amsgrad,
// maximize) (float64 [r, 7]) and the new step. Bias corrections are computed in double as
// torch's Python code does (1 - beta ** step, lr / bc1, bc2 ** 0.5, 1 - lr * wd), then cast to
// the tensors' dtype as torch casts a Python scalar.
//
// ``fma_lerp`` / ``fma_addcmul``: whether torch's CPU kernels for exp_avg.lerp_(grad, w) and
// exp_avg_sq.addcmul_(grad, grad, value=c) round once (a fused multiply-add, as torch's AVX2 /
// AVX-512 builds do) or twice. ``sqrt_mode`` (adamw::SqrtMode): 0, an IEEE square root (torch
// builds without MKL); 1, MKL's VML root, torch's CPU sqrt on x86 builds with MKL; 2, MKL's root
// except for +0 and positive subnormals, whose roots are IEEE's (the same bits where MKL's roots of
// them are IEEE's, without VML's slow path for them). The caller finds out by running torch's ops
// (mfsdp2/optim/kernel.py).
void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                const at::Tensor& segments, const at::Tensor& hyper, bool fma_lerp, bool fma_addcmul,
                int64_t sqrt_mode);

// Whether the torch this module runs with exports MKL's VML square roots (vmsSqrt, vmdSqrt).
bool has_vml_sqrt();

}  // namespace mfsdp2
