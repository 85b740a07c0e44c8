// torch AdamW's step over segments of flat tensors: one pass that reads the parameter, its
// gradient and its two moments and writes them back (28 bytes per float32 element, 36 with
// amsgrad), where torch's for-loop / foreach AdamW makes about ten passes per parameter.
//
// Every element gets the arithmetic of torch's CPU kernels in torch's order, one rounding per
// torch op (the build has -ffp-contract=off, so the compiler fuses nothing on its own):
//   p  = p * (1 - lr wd)                          param.mul_(1 - lr * weight_decay)
//   m  = lerp(m, g, 1 - beta1)                    exp_avg.lerp_(grad, 1 - beta1)
//   v  = v * beta2;  v = v + ((1 - beta2) g) g    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   vmax = maximum(vmax, v)                       (amsgrad) torch.maximum(max_exp_avg_sq, exp_avg_sq, out=...)
//   den = sqrt(v or vmax) / sqrt(bc2) + eps       (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   p  = p + ((-lr / bc1) m) / den                param.addcdiv_(exp_avg, denom, value=-step_size)
// torch's lerp is w (g - m) + m for |w| < 0.5, else (w - 1)(g - m) + g; its AVX2 / AVX-512
// kernels round that once (an explicit fused multiply-add), and their compiler contracted
// addcmul's ((1 - beta2) g) g + v into one too; a build without FMA rounds each twice. torch's
// sqrt is MKL's (below) where torch has MKL. The caller says which (``fma_lerp``, ``fma_addcmul``,
// ``sqrt_mode``), having run torch's ops to find out. With an IEEE root the step is one loop; with
// MKL's, a work item runs in blocks of kBlock elements: moments (storing what the root is taken
// of), MKL's roots of the block, the update (about 40 % slower than one loop). VML takes the roots
// of +0 and subnormals on a slow path, 20 to 50 times an ordinary element's cost, and AdamW's
// exp_avg_sq underflows to them wherever gradients are small; sqrt_mode 2 gives VML a 1 in their
// place and takes their IEEE roots in the update (MKL's HA roots of them are IEEE's; the probe
// checks), which keeps a step over such data at about the cost of one over normal numbers.
#include "adamw.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "adamw_math.h"
#include "adamw_table.h"
#include "segments.h"
#include "simd.h"

namespace mfsdp2 {
namespace {

using adamw::Coef;
using adamw::Hyper;
using adamw::kBlock;

// The moments: m, v (and vmax) are stored, ``second`` gets v (or vmax), what the square root is
// taken of. ``kBypass`` (kMklNormalSqrt): an input adamw::tiny is replaced by 1 (a fast VML
// element; its root is taken again by update_bypass), and the return value says whether the block
// held any.
template <typename T, bool kFmaLerp, bool kFmaAddcmul, bool kAmsgrad, bool kBypass>
MFSDP2_CLONES bool moments(const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax,
                           T* __restrict second, int64_t n, const Coef<T> c) {
  using U = typename adamw::Bits<T>::type;
  U hits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T gi = adamw::signed_grad(g[i], c);
    T mn, vn;
    adamw::moments_of<T, kFmaLerp, kFmaAddcmul>(gi, m[i], v[i], c, mn, vn);
    T s = vn;
    if constexpr (kAmsgrad) {
      s = adamw::maximum_of(vmax[i], vn);
      vmax[i] = s;
    }
    m[i] = mn;
    v[i] = vn;
    if constexpr (kBypass) {
      const bool t = adamw::tiny(s);
      hits |= t ? U(1) : U(0);
      second[i] = t ? T(1) : s;
    } else {
      second[i] = s;
    }
  }
  return hits != 0;
}

// p's update from the stored m and the block's roots.
template <typename T, bool kRecip>
MFSDP2_CLONES void update(T* __restrict p, const T* __restrict m, const T* __restrict root, int64_t n, const Coef<T> c) {
  for (int64_t i = 0; i < n; ++i) p[i] = adamw::updated<T, kRecip>(p[i], m[i], root[i], c);
}

// The same where the block held tiny inputs: ``s`` is what the roots were taken of (the stored v
// or vmax); a tiny one gets its IEEE root, every other element MKL's from ``root``.
template <typename T, bool kRecip>
MFSDP2_CLONES void update_bypass(T* __restrict p, const T* __restrict m, const T* __restrict root,
                                 const T* __restrict s, int64_t n, const Coef<T> c) {
  for (int64_t i = 0; i < n; ++i) {
    const T si = s[i];
    const T r = adamw::tiny(si) ? std::sqrt(si) : root[i];
    p[i] = adamw::updated<T, kRecip>(p[i], m[i], r, c);
  }
}

// All of it in one loop, with an IEEE square root (torch builds without MKL).
template <typename T, bool kFmaLerp, bool kFmaAddcmul, bool kAmsgrad, bool kRecip>
MFSDP2_CLONES void whole(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax,
                         int64_t n, const Coef<T> c) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = adamw::signed_grad(g[i], c);
    T mn, vn;
    adamw::moments_of<T, kFmaLerp, kFmaAddcmul>(gi, m[i], v[i], c, mn, vn);
    T s = vn;
    if constexpr (kAmsgrad) {
      s = adamw::maximum_of(vmax[i], vn);
      vmax[i] = s;
    }
    p[i] = adamw::updated<T, kRecip>(p[i], mn, std::sqrt(s), c);
    m[i] = mn;
    v[i] = vn;
  }
}

template <typename T, bool kFmaLerp, bool kFmaAddcmul, bool kAmsgrad, bool kRecip>
void step_range(T* p, const T* g, T* m, T* v, T* vmax, int64_t n, const Coef<T>& c, int64_t sqrt_mode) {
  if (sqrt_mode == adamw::kIeeeSqrt) {
    whole<T, kFmaLerp, kFmaAddcmul, kAmsgrad, kRecip>(p, g, m, v, vmax, n, c);
    return;
  }
  alignas(64) T root[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t k = std::min(kBlock, n - b);
    T* vm = kAmsgrad ? vmax + b : nullptr;
    if (sqrt_mode == adamw::kMklSqrt) {
      moments<T, kFmaLerp, kFmaAddcmul, kAmsgrad, false>(g + b, m + b, v + b, vm, root, k, c);
      adamw::vml_sqrt(root, k);
      update<T, kRecip>(p + b, m + b, root, k, c);
      continue;
    }
    const bool tiny = moments<T, kFmaLerp, kFmaAddcmul, kAmsgrad, true>(g + b, m + b, v + b, vm, root, k, c);
    adamw::vml_sqrt(root, k);
    if (tiny)
      update_bypass<T, kRecip>(p + b, m + b, root, kAmsgrad ? vm : v + b, k, c);
    else
      update<T, kRecip>(p + b, m + b, root, k, c);
  }
}

template <typename T, bool kFmaLerp, bool kFmaAddcmul>
void step_one(T* p, const T* g, T* m, T* v, T* vmax, int64_t n, const Coef<T>& c, int64_t sqrt_mode) {
  if (c.amsgrad && c.recip)
    step_range<T, kFmaLerp, kFmaAddcmul, true, true>(p, g, m, v, vmax, n, c, sqrt_mode);
  else if (c.amsgrad)
    step_range<T, kFmaLerp, kFmaAddcmul, true, false>(p, g, m, v, vmax, n, c, sqrt_mode);
  else if (c.recip)
    step_range<T, kFmaLerp, kFmaAddcmul, false, true>(p, g, m, v, vmax, n, c, sqrt_mode);
  else
    step_range<T, kFmaLerp, kFmaAddcmul, false, false>(p, g, m, v, vmax, n, c, sqrt_mode);
}

template <typename T>
void step_any(bool fma_lerp, bool fma_addcmul, int64_t sqrt_mode, T* p, const T* g, T* m, T* v, T* vmax, int64_t n,
              const Coef<T>& c) {
  if (fma_lerp && fma_addcmul) step_one<T, true, true>(p, g, m, v, vmax, n, c, sqrt_mode);
  else if (fma_lerp) step_one<T, true, false>(p, g, m, v, vmax, n, c, sqrt_mode);
  else if (fma_addcmul) step_one<T, false, true>(p, g, m, v, vmax, n, c, sqrt_mode);
  else step_one<T, false, false>(p, g, m, v, vmax, n, c, sqrt_mode);
}

struct Range {
  int64_t flat, begin, end, coef;
};

template <typename T>
void run(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
         const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
         const int64_t* seg, int64_t n, const std::vector<Hyper>& hyper, bool fma_lerp, bool fma_addcmul,
         int64_t sqrt_mode) {
  // Count the steps and make each segment's coefficients (serial: a few per parameter).
  std::vector<Coef<T>> coefs(n);
  std::vector<std::tuple<int64_t, int64_t, double>> keys(n);  // (hyper row, flat, step): equal keys, equal coefficients
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = seg + 5 * s;
    const double step = adamw::count_step(steps[r[0]], r[4]);
    coefs[s] = adamw::coefficients<T>(hyper[r[3]], step);
    keys[s] = {r[3], r[0], step};
  }
  // Adjacent pieces with the same coefficients form one range, cut into work items counted from
  // the range's start (independent of the thread count, so any thread count writes the same bytes).
  std::vector<Range> items;
  int64_t total = 0;
  int64_t open = -1;  // the segment whose coefficients the last range uses
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = seg + 5 * s;
    if (r[2] == 0) continue;
    if (open >= 0 && keys[open] == keys[s] && seg[5 * open] == r[0] && !items.empty() &&
        items.back().end == r[1] && items.back().end - items.back().begin < kItem) {
      // extend the last item up to kItem elements, then open new items of the same range
      const int64_t room = kItem - (items.back().end - items.back().begin);
      const int64_t take = std::min(room, r[2]);
      items.back().end += take;
      for (int64_t b = r[1] + take; b < r[1] + r[2]; b += kItem)
        items.push_back({r[0], b, std::min(b + kItem, r[1] + r[2]), open});
    } else {
      open = s;
      for (int64_t b = r[1]; b < r[1] + r[2]; b += kItem)
        items.push_back({r[0], b, std::min(b + kItem, r[1] + r[2]), s});
    }
    total += r[2];
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t grain = total >= 4 * kItem ? 1 : (count > 0 ? count : 1);
  at::parallel_for(0, count, grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Range& it = items[k];
      const Coef<T>& c = coefs[it.coef];
      T* vmax = c.amsgrad ? max_exp_avg_sqs[it.flat].data_ptr<T>() + it.begin : nullptr;
      step_any<T>(fma_lerp, fma_addcmul, sqrt_mode, params[it.flat].data_ptr<T>() + it.begin,
                  grads[it.flat].data_ptr<T>() + it.begin, exp_avgs[it.flat].data_ptr<T>() + it.begin,
                  exp_avg_sqs[it.flat].data_ptr<T>() + it.begin, vmax, it.end - it.begin, c);
    }
  });
}

}  // namespace

bool has_vml_sqrt() { return vmsSqrt != nullptr && vmdSqrt != nullptr; }

void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                const at::Tensor& segments, const at::Tensor& hyper, bool fma_lerp, bool fma_addcmul,
                int64_t sqrt_mode) {
  TORCH_CHECK(sqrt_mode >= adamw::kIeeeSqrt && sqrt_mode <= adamw::kMklNormalSqrt, "adamw_step: sqrt_mode must be 0, 1 or 2, got ",
              sqrt_mode);
  TORCH_CHECK(sqrt_mode == adamw::kIeeeSqrt || has_vml_sqrt(),
              "adamw_step: an MKL square root asked for, but this torch exports no MKL VML sqrt");
  const size_t nf = params.size();
  const adamw::Table table = adamw::read_table("adamw_step", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                               steps, segments, 5, hyper, /*double_steps=*/true);
  const at::ScalarType dtype = nf ? params[0].scalar_type() : at::kFloat;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "adamw_step: float32 or float64 tensors expected, got ", dtype);
  const std::vector<Hyper>& hy = table.hyper;
  const int64_t n = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (size_t f = 0; f < nf; ++f) {
    const int64_t numel = params[f].numel();
    adamw::check_flat("adamw_step", params[f], dtype, numel, "params", f);
    adamw::check_flat("adamw_step", grads[f], dtype, numel, "grads", f);
    adamw::check_flat("adamw_step", exp_avgs[f], dtype, numel, "exp_avgs", f);
    adamw::check_flat("adamw_step", exp_avg_sqs[f], dtype, numel, "exp_avg_sqs", f);
    if (table.needs_max[f]) adamw::check_flat("adamw_step", max_exp_avg_sqs[f], dtype, numel, "max_exp_avg_sqs", f);
  }
  if (dtype == at::kFloat)
    run<float>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, seg, n, hy, fma_lerp, fma_addcmul, sqrt_mode);
  else
    run<double>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, seg, n, hy, fma_lerp, fma_addcmul, sqrt_mode);
}

}  // namespace mfsdp2
