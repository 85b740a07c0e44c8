// The arithmetic torch AdamW's for-loop / foreach step does per element, shared by the kernels
// over float32 / float64 states (adamw.cpp) and over bfloat16 states (adamw_bf16.cpp): the
// per-segment coefficients, computed as torch's Python code computes them, and the moment
// updates, rounded as torch's CPU kernels round them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

// torch's CPU sqrt of float / double tensors is MKL's VML (vmsSqrt / vmdSqrt, high accuracy,
// denormals kept: ATen/cpu/vml.h), which rounds about 0.7 % of float32 results the other way
// than an IEEE square root. Where the torch this module runs with has MKL inside, its VML
// functions are exported by libtorch_cpu; weak references find them there (null elsewhere).
extern "C" {
void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
void vmdSqrt(int n, const double* a, double* r, long long mode) __attribute__((weak));
}

namespace mfsdp2 {
namespace adamw {

constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as torch
constexpr int64_t kBlock = 2048;  // elements per pass of moments / sqrt / update: they stay in L1 / L2

// How the kernel takes torch's square root (``adamw_step``'s ``sqrt_mode``).
enum SqrtMode : int64_t {
  kIeeeSqrt = 0,     // an IEEE root everywhere (torch builds without MKL)
  kMklSqrt = 1,      // MKL's VML root of every element
  kMklNormalSqrt = 2,  // MKL's root of all but +0 and positive subnormals, whose roots are IEEE's
};

inline void vml_sqrt(float* x, int64_t n) { vmsSqrt(static_cast<int>(n), x, x, kVmlMode); }
inline void vml_sqrt(double* x, int64_t n) { vmdSqrt(static_cast<int>(n), x, x, kVmlMode); }

template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using type = uint32_t;
};
template <>
struct Bits<double> {
  using type = uint64_t;
};

template <typename T>
__attribute__((always_inline)) inline typename Bits<T>::type to_bits(T x) {
  typename Bits<T>::type u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

template <typename T>
__attribute__((always_inline)) inline T from_bits(typename Bits<T>::type u) {
  T x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// +0 or a positive subnormal: MKL's VML takes these roots on a slow path (about 20x an ordinary
// element's cost for float32, 50x for float64) and its HA roots of them are IEEE's (checked by the
// probe, mfsdp2/optim/kernel.py), so kMklNormalSqrt takes them with an IEEE root instead. AdamW's
// exp_avg_sq meets them often: it underflows where gradients are small (vanishing gradients, rows
// without gradient decaying by beta2 each step). Negative inputs, infinities and NaNs stay MKL's.
template <typename T>
__attribute__((always_inline)) inline bool tiny(T x) {
  using U = typename Bits<T>::type;
  return to_bits(x) < (U(1) << (std::numeric_limits<T>::digits - 1));  // below the smallest normal's bits
}

// One segment's coefficients, in the tensors' dtype (torch casts each Python scalar so).
template <typename T>
struct Coef {
  T decay;          // 1 - lr * weight_decay (1 without weight decay: p * 1 is p)
  T lerp_w;         // w = 1 - beta1 when |w| < 0.5, else w - 1
  bool small;       // which lerp form: w (g - m) + m, or (w - 1)(g - m) + g
  // ``small`` and ``maximize`` as bit masks of T's width: the loops select and negate with them
  // (GCC does not vectorize a loop that reads a bool from memory).
  typename Bits<T>::type small_mask;  // all ones when small
  typename Bits<T>::type sign_mask;   // the sign bit under maximize (-g is g with its sign flipped)
  T beta2;
  T one_minus_beta2;
  T bc2_sqrt;       // (1 - beta2 ** step) ** 0.5
  T eps;
  T neg_step_size;  // -lr / (1 - beta1 ** step)
  T inv_bc2_sqrt;   // RN(1 / bc2_sqrt), in T's arithmetic
  bool recip;       // divide by bc2_sqrt through inv_bc2_sqrt (div_bc2): FMA in hardware, bc2_sqrt in range
  bool amsgrad;
  bool maximize;
};

// Whether this CPU has fused multiply-adds in hardware (without, std::fma is a slow library call).
inline bool has_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("fma");
  return yes;
#else
  return true;
#endif
}

// The smallest bc2_sqrt div_bc2 takes the reciprocal's way: the residual of a root's quotient
// (about 2^-p of a root, the smallest nonzero root being the square root of the smallest
// subnormal) must stay a normal number for the correction to be exact.
template <typename T>
constexpr T kRecipMin = T(0x1p-20);

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

// torch's Python arithmetic in double (Python floats are C doubles, ``**`` is libm's pow), then
// the casts torch makes when it hands each scalar to a kernel.
template <typename T>
Coef<T> coefficients(const Hyper& h, double step) {
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bc1;
  const double bc2_sqrt = std::pow(bc2, 0.5);
  Coef<T> c;
  const T w = static_cast<T>(1.0 - h.beta1);
  c.small = std::abs(w) < T(0.5);
  c.lerp_w = c.small ? w : w - T(1);
  c.decay = h.weight_decay != 0.0 ? static_cast<T>(1.0 - h.lr * h.weight_decay) : T(1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<T>(bc2_sqrt);
  c.eps = static_cast<T>(h.eps);
  c.neg_step_size = static_cast<T>(-step_size);
  c.inv_bc2_sqrt = T(1) / c.bc2_sqrt;
  c.recip = has_fma() && c.bc2_sqrt >= kRecipMin<T> && c.bc2_sqrt <= T(1);
  c.amsgrad = h.amsgrad;
  c.maximize = h.maximize;
  using U = typename Bits<T>::type;
  c.small_mask = c.small ? ~U(0) : U(0);
  c.sign_mask = h.maximize ? U(1) << (8 * sizeof(U) - 1) : U(0);
  return c;
}

// steps[slot] += 1 in the counter's dtype (torch's ``step_t += 1``); the new count.
inline double count_step(const at::Tensor& steps, int64_t slot) {
  if (steps.scalar_type() == at::kFloat) {
    float* s = steps.data_ptr<float>() + slot;
    *s = *s + 1.0f;
    return *s;
  }
  double* s = steps.data_ptr<double>() + slot;
  *s = *s + 1.0;
  return *s;
}

// The gradient as the step sees it: negated under maximize.
template <typename T>
__attribute__((always_inline)) inline T signed_grad(T g, const Coef<T>& c) {
  return from_bits<T>(to_bits(g) ^ c.sign_mask);
}

// m = lerp(m, g, 1 - beta1) and v = v beta2 + ((1 - beta2) g) g for one element, ``g`` already
// through signed_grad; ``kFmaLerp`` / ``kFmaAddcmul``: one rounding (a fused multiply-add, as
// torch's AVX2 / AVX-512 kernels) or two.
template <typename T, bool kFmaLerp, bool kFmaAddcmul>
__attribute__((always_inline)) inline void moments_of(T g, T m, T v, const Coef<T>& c, T& m_out, T& v_out) {
  const T d = g - m;
  const T base = from_bits<T>((to_bits(m) & c.small_mask) | (to_bits(g) & ~c.small_mask));
  m_out = kFmaLerp ? std::fma(c.lerp_w, d, base) : c.lerp_w * d + base;
  const T v1 = v * c.beta2;
  const T gs = c.one_minus_beta2 * g;
  v_out = kFmaAddcmul ? std::fma(gs, g, v1) : v1 + gs * g;
}

// torch.maximum(a, b): NaN when either is NaN.
template <typename T>
__attribute__((always_inline)) inline T maximum_of(T a, T b) {
  T mx = a > b ? a : b;
  mx = a != a ? a : mx;
  return b != b ? b : mx;
}

// root / bc2_sqrt, correctly rounded. ``kRecip``: without a division (the divider is the step's
// bottleneck beside the roots and the update's quotient), by Markstein's correction: q = RN(x z)
// with z = RN(1 / y) is faithful, the residual r = x - q y is exact (an FMA), and RN(q + r z) is
// RN(x / y) (Markstein's theorem; checked exhaustively here over every float32 root from 2^-75 to
// 2^70 for divisors across [2^-20, 1], and on 4e9 random pairs). Where it does not apply: x = 0
// (q is x's signed zero), x = inf (the residual is NaN; q is inf), x = NaN (q is NaN); ``recip``
// is off for bc2_sqrt outside [2^-20, 1] (the residual of the smallest roots could underflow).
template <typename T, bool kRecip>
__attribute__((always_inline)) inline T div_bc2(T x, const Coef<T>& c) {
  if constexpr (kRecip) {
    const T q = x * c.inv_bc2_sqrt;
    const T r = std::fma(-q, c.bc2_sqrt, x);
    const T q2 = std::fma(r, c.inv_bc2_sqrt, q);
    return (r == r && q != T(0)) ? q2 : q;
  } else {
    return x / c.bc2_sqrt;
  }
}

// p = p * decay + ((-lr / bc1) m) / (root / sqrt(bc2) + eps), root = sqrt(v or vmax).
template <typename T, bool kRecip>
__attribute__((always_inline)) inline T updated(T p, T m, T root, const Coef<T>& c) {
  const T den = div_bc2<T, kRecip>(root, c) + c.eps;
  return p * c.decay + (c.neg_step_size * m) / den;
}

}  // namespace adamw
}  // namespace mfsdp2
