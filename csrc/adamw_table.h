// The argument checks the AdamW kernels share (adamw.cpp: float32 / float64 moments;
// adamw_bf16.cpp: bfloat16 moments): the list lengths, the hyper-parameter rows and the segment
// table, whose rows begin (flat, offset, length, hyper row, step slot). Errors name the kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "adamw_math.h"

namespace mfsdp2 {
namespace adamw {

struct Table {
  std::vector<Hyper> hyper;     // one per hyper-parameter row
  std::vector<bool> needs_max;  // per flat: a non-empty segment of it uses amsgrad
};

// Reads ``hyper`` (float64 [rows, 7]) and checks ``segments`` (int64 [n, cols]): flats, hyper rows
// and step slots exist, non-empty segments lie inside their flat and do not overlap (threads
// write them). ``steps``: float32 (or float64 where ``double_steps``) 1-D CPU counters.
Table read_table(const char* fn, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                 const at::Tensor& segments, int64_t cols, const at::Tensor& hyper, bool double_steps);

// ``x`` is a contiguous 1-D CPU tensor of ``dtype`` and ``numel`` elements (``name[f]`` in errors).
void check_flat(const char* fn, const at::Tensor& x, at::ScalarType dtype, int64_t numel, const char* name, size_t f);

}  // namespace adamw
}  // namespace mfsdp2
