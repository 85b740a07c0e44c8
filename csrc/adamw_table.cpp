#include "adamw_table.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>

namespace mfsdp2 {
namespace adamw {

Table read_table(const char* fn, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                 const at::Tensor& segments, int64_t cols, const at::Tensor& hyper, bool double_steps) {
  const size_t nf = params.size();
  TORCH_CHECK(grads.size() == nf && exp_avgs.size() == nf && exp_avg_sqs.size() == nf &&
                  max_exp_avg_sqs.size() == nf && steps.size() == nf,
              fn, ": params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs and steps must have one entry per flat "
              "tensor (", nf, ")");
  TORCH_CHECK(hyper.device().is_cpu() && hyper.scalar_type() == at::kDouble && hyper.dim() == 2 &&
                  hyper.size(1) == 7 && hyper.is_contiguous(),
              fn, ": hyper must be a contiguous float64 [rows, 7] CPU tensor, got ", hyper.sizes(), " ",
              hyper.scalar_type());
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == cols && segments.is_contiguous(),
              fn, ": segments must be a contiguous int64 [n, ", cols, "] CPU tensor, got ", segments.sizes(), " ",
              segments.scalar_type());
  Table t;
  t.hyper.resize(hyper.size(0));
  const double* hp = hyper.data_ptr<double>();
  for (size_t r = 0; r < t.hyper.size(); ++r) {
    const double* h = hp + 7 * r;
    t.hyper[r] = {h[0], h[1], h[2], h[3], h[4], h[5] != 0.0, h[6] != 0.0};
  }
  t.needs_max.assign(nf, false);
  const int64_t n = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<std::tuple<int64_t, int64_t, int64_t>> spans;  // (flat, begin, end) of non-empty segments
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = seg + cols * s;
    TORCH_CHECK(r[0] >= 0 && r[0] < static_cast<int64_t>(nf), fn, ": segment ", s, " names flat ", r[0], " of ", nf);
    TORCH_CHECK(r[3] >= 0 && r[3] < static_cast<int64_t>(t.hyper.size()), fn, ": segment ", s, " names hyper row ",
                r[3], " of ", t.hyper.size());
    const at::Tensor& st = steps[r[0]];
    TORCH_CHECK(st.device().is_cpu() && (st.scalar_type() == at::kFloat || (double_steps && st.scalar_type() == at::kDouble)) &&
                    st.dim() == 1 && st.is_contiguous(),
                fn, ": steps[", r[0], "] must be a contiguous 1-D float32", double_steps ? " or float64" : "",
                " CPU tensor");
    TORCH_CHECK(r[4] >= 0 && r[4] < st.numel(), fn, ": segment ", s, " names step slot ", r[4], " of ", st.numel());
    const int64_t numel = params[r[0]].numel();
    TORCH_CHECK(r[2] >= 0 && (r[2] == 0 || (r[1] >= 0 && r[1] <= numel && r[2] <= numel - r[1])), fn, ": segment ",
                s, " (offset ", r[1], ", length ", r[2], ") lies outside flat ", r[0], " of ", numel, " elements");
    for (int64_t c = 5; c < cols; ++c)
      TORCH_CHECK(r[c] >= 0, fn, ": segment ", s, " has a negative entry in column ", c);
    if (r[2] > 0) {
      spans.emplace_back(r[0], r[1], r[1] + r[2]);
      if (t.hyper[r[3]].amsgrad) t.needs_max[r[0]] = true;
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    TORCH_CHECK(std::get<0>(spans[k]) != std::get<0>(spans[k - 1]) || std::get<1>(spans[k]) >= std::get<2>(spans[k - 1]),
                fn, ": segments overlap in flat ", std::get<0>(spans[k]), " (at element ", std::get<1>(spans[k]),
                "); each element may be stepped once");
  }
  return t;
}

void check_flat(const char* fn, const at::Tensor& x, at::ScalarType dtype, int64_t numel, const char* name, size_t f) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), fn, ": ", name, "[", f,
              "] must be a contiguous 1-D CPU tensor, got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype && x.numel() == numel, fn, ": ", name, "[", f, "] must be ", dtype, " with ",
              numel, " elements (as params[", f, "]), got ", x.scalar_type(), " with ", x.numel());
}

}  // namespace adamw
}  // namespace mfsdp2
