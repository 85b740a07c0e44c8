// torch AdamW's step with bfloat16 moments and float32 parameters and gradients: 20 bytes per
// element (24 with amsgrad) where float32 moments take 28 (36).
//
// Each element's moments are widened to float32 (exact), updated with the arithmetic of the
// float32 kernel (adamw_math.h: torch's for-loop AdamW, rounded as torch's CPU kernels round),
// the parameter is updated from those float32 moments, and the moments are stored back by
// stochastic rounding: the float32 bits plus 16 random bits, truncated. Rounding to nearest would
// lose every update smaller than half a bfloat16 step -- exp_avg_sq's (1 - beta2) g^2 against
// v beta2 is one at beta2 = 0.999 -- while stochastic rounding rounds up with probability equal
// to the fraction cut off, so the stored moment is exact in expectation.
//
// The random bits are a hash of (seed, parameter id, step, element index within the parameter):
// the same element gets the same bits whatever the sharding, the rank or the thread count, and
// the pure-PyTorch reference (mfsdp2/optim/bf16_states.py) computes the same hash.
//
// The square root is IEEE's (correctly rounded), not torch's CPU sqrt (MKL's VML, which rounds
// about 0.7 % of results the other way): these moments are not torch's format, so there are no
// torch bits to reproduce, and the single vectorised loop runs about 40 % faster than the blocks
// an MKL root needs. The PyTorch reference takes an IEEE root too.
#include "adamw_bf16.h"

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

// lowbias32 (C. Wellons' integer hash), the multipliers below 2^31 so that the PyTorch reference
// computes it in int64 without overflow.
__attribute__((always_inline)) inline uint32_t h32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

__attribute__((always_inline)) inline float widen(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// Stochastic rounding to bfloat16 with 16 random bits ``r``; every NaN becomes 0x7FC0.
__attribute__((always_inline)) inline uint16_t narrow(float x, uint32_t r) {
  const uint16_t t = static_cast<uint16_t>((bits_of(x) + r) >> 16);
  return x != x ? static_cast<uint16_t>(0x7FC0) : t;
}

// One run of elements; ``lo0``: the low 32 bits of the first element's index in its parameter
// (the run never crosses a multiple of 2^32), ``salt``: the run's hash salt.
template <bool kFmaLerp, bool kFmaAddcmul, bool kAmsgrad, bool kRecip>
MFSDP2_CLONES void run_bf16(float* __restrict p, const float* __restrict g, uint16_t* __restrict m,
                            uint16_t* __restrict v, uint16_t* __restrict vmax, int64_t n, const Coef<float> c,
                            uint32_t salt, uint32_t lo0) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = adamw::signed_grad(g[i], c);
    float mn, vn;
    adamw::moments_of<float, kFmaLerp, kFmaAddcmul>(gi, widen(m[i]), widen(v[i]), c, mn, vn);
    const uint32_t r = h32((lo0 + static_cast<uint32_t>(i)) ^ salt);
    float s = vn;
    if constexpr (kAmsgrad) {
      s = adamw::maximum_of(widen(vmax[i]), vn);
      vmax[i] = narrow(s, h32(r ^ 0x9e3779b9u) >> 16);
    }
    m[i] = narrow(mn, r >> 16);
    v[i] = narrow(vn, r & 0xffffu);
    p[i] = adamw::updated<float, kRecip>(p[i], mn, std::sqrt(s), c);
  }
}

template <bool kFmaLerp, bool kFmaAddcmul>
void step_item(float* p, const float* g, uint16_t* m, uint16_t* v, uint16_t* vmax, int64_t n, const Coef<float>& c,
               uint32_t salt, uint32_t lo0) {
  if (c.amsgrad && c.recip)
    run_bf16<kFmaLerp, kFmaAddcmul, true, true>(p, g, m, v, vmax, n, c, salt, lo0);
  else if (c.amsgrad)
    run_bf16<kFmaLerp, kFmaAddcmul, true, false>(p, g, m, v, vmax, n, c, salt, lo0);
  else if (c.recip)
    run_bf16<kFmaLerp, kFmaAddcmul, false, true>(p, g, m, v, vmax, n, c, salt, lo0);
  else
    run_bf16<kFmaLerp, kFmaAddcmul, false, false>(p, g, m, v, vmax, n, c, salt, lo0);
}

// A work item: elements [begin, end) of flat ``flat``, of segment ``seg``, whose first element is
// element ``elem`` of its parameter.
struct Bf16Item {
  int64_t flat, begin, end, seg, elem;
};

}  // namespace

uint32_t bf16_salt(int64_t seed, int64_t param_id, double step) {
  const uint32_t a = h32(static_cast<uint32_t>(static_cast<uint64_t>(step)));
  const uint32_t b = h32(a ^ static_cast<uint32_t>(param_id));
  return h32(b ^ static_cast<uint32_t>(seed));
}

void adamw_step_bf16(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
                     const at::Tensor& segments, const at::Tensor& hyper, int64_t seed, bool fma_lerp,
                     bool fma_addcmul) {
  const size_t nf = params.size();
  const adamw::Table table = adamw::read_table("adamw_step_bf16", params, grads, exp_avgs, exp_avg_sqs,
                                               max_exp_avg_sqs, steps, segments, 7, hyper, /*double_steps=*/false);
  const std::vector<Hyper>& hy = table.hyper;
  const int64_t n = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (size_t f = 0; f < nf; ++f) {
    const int64_t numel = params[f].numel();
    adamw::check_flat("adamw_step_bf16", params[f], at::kFloat, numel, "params", f);
    adamw::check_flat("adamw_step_bf16", grads[f], at::kFloat, numel, "grads", f);
    adamw::check_flat("adamw_step_bf16", exp_avgs[f], at::kBFloat16, numel, "exp_avgs", f);
    adamw::check_flat("adamw_step_bf16", exp_avg_sqs[f], at::kBFloat16, numel, "exp_avg_sqs", f);
    if (table.needs_max[f])
      adamw::check_flat("adamw_step_bf16", max_exp_avg_sqs[f], at::kBFloat16, numel, "max_exp_avg_sqs", f);
  }
  // Count the steps, make each segment's coefficients and salt, cut segments into work items
  // (at kItem elements and at multiples of 2^32 of the element index: the hash takes 32 bits).
  std::vector<Coef<float>> coefs(n);
  std::vector<uint32_t> salts(n);
  std::vector<Bf16Item> items;
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* r = seg + 7 * s;
    const double step = adamw::count_step(steps[r[0]], r[4]);
    coefs[s] = adamw::coefficients<float>(hy[r[3]], step);
    salts[s] = bf16_salt(seed, r[5], step);
    for (int64_t b = 0; b < r[2];) {
      const int64_t elem = r[6] + b;
      const int64_t to_wrap = (int64_t(1) << 32) - (elem & 0xffffffffLL);
      const int64_t k = std::min({kItem, r[2] - b, to_wrap});
      items.push_back({r[0], r[1] + b, r[1] + b + k, s, elem});
      b += k;
    }
    total += r[2];
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t grain = total >= 4 * kItem ? 1 : (count > 0 ? count : 1);
  at::parallel_for(0, count, grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Bf16Item& it = items[k];
      const Coef<float>& c = coefs[it.seg];
      const uint32_t hi = static_cast<uint32_t>(it.elem >> 32);
      const uint32_t salt = hi ? h32(salts[it.seg] ^ hi) : salts[it.seg];
      const uint32_t lo0 = static_cast<uint32_t>(it.elem);
      auto bf = [&](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()) + it.begin; };
      uint16_t* vmax = c.amsgrad ? bf(max_exp_avg_sqs[it.flat]) : nullptr;
      float* p = params[it.flat].data_ptr<float>() + it.begin;
      const float* g = grads[it.flat].data_ptr<float>() + it.begin;
      uint16_t* m = bf(exp_avgs[it.flat]);
      uint16_t* v = bf(exp_avg_sqs[it.flat]);
      const int64_t len = it.end - it.begin;
      if (fma_lerp && fma_addcmul) step_item<true, true>(p, g, m, v, vmax, len, c, salt, lo0);
      else if (fma_lerp) step_item<true, false>(p, g, m, v, vmax, len, c, salt, lo0);
      else if (fma_addcmul) step_item<false, true>(p, g, m, v, vmax, len, c, salt, lo0);
      else step_item<false, false>(p, g, m, v, vmax, len, c, salt, lo0);
    }
  });
}

}  // namespace mfsdp2
