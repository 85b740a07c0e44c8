// Per-segment reductions over a flat buffer: sums of squares (+ non-finite flags) and amax.
#include "reductions.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "segments.h"
#include "simd.h"

namespace mfsdp2 {
namespace {

constexpr int kLanes = 8;

// Sum of x^2 over n values in float64, lane l taking elements l, l + 8, ...: the lanes are
// fixed, so the order of the additions is too. A float32 or bfloat16 square is exact in
// float64 (24-bit mantissas), so the only rounding is in the n - 1 additions.
template <typename Load>
inline double sumsq(int64_t n, const Load& load) {
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double v = load(i + l);
      acc[l] += v * v;
    }
  for (int l = 0; i + l < n; ++l) {
    const double v = load(i + l);
    acc[l] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

MFSDP2_CLONES double sumsq_f32(const float* __restrict x, int64_t n) {
  return sumsq(n, [x](int64_t i) { return x[i]; });
}

MFSDP2_CLONES double sumsq_bf16(const uint16_t* __restrict x, int64_t n) {
  return sumsq(n, [x](int64_t i) { return float_of(static_cast<uint32_t>(x[i]) << 16); });
}

// max |x| over n values, as float32 words with the sign cleared: for non-NaN values the
// integer order of those words is the float order, and every NaN word is above infinity's
// (0x7F800000), so an integer max (exact, any order, vectorisable) is the float max and is a
// NaN exactly when some value is.
MFSDP2_CLONES uint32_t amax_bits(const float* __restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

void check_flat(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), what,
              ": expected a contiguous 1-D CPU tensor, got ", x.sizes(), " on ", x.device());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> segment_sumsq(const at::Tensor& x, const at::Tensor& offsets,
                                                 const at::Tensor& lengths) {
  check_flat(x, "segment_sumsq");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "segment_sumsq: float32 or bfloat16 input expected, got ", x.scalar_type());
  const SegmentTable t = make_table(offsets, lengths, x.numel(), false, "segment_sumsq");
  std::vector<double> part(t.items.size());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* base = x.data_ptr();
  for_each_item(t, [&](int64_t k) {
    const Item& it = t.items[k];
    part[k] = bf16 ? sumsq_bf16(static_cast<const uint16_t*>(base) + it.begin, it.end - it.begin)
                   : sumsq_f32(static_cast<const float*>(base) + it.begin, it.end - it.begin);
  });
  at::Tensor sums = at::empty({t.size()}, x.options().dtype(at::kDouble));
  at::Tensor bad = at::empty({t.size()}, x.options().dtype(at::kBool));
  double* s = sums.data_ptr<double>();
  bool* b = bad.data_ptr<bool>();
  for (int64_t seg = 0; seg < t.size(); ++seg) {
    double acc = 0.0;
    for (int64_t k = t.first_item[seg]; k < t.first_item[seg + 1]; ++k) acc += part[k];
    s[seg] = acc;
    // Finite float32 / bfloat16 squares are below 2^256 and a buffer holds fewer than 2^63 of
    // them, so a float64 sum of finite values is finite: the sum is non-finite exactly when
    // some value is (inf^2 = inf, NaN^2 = NaN).
    b[seg] = !std::isfinite(acc);
  }
  return {sums, bad};
}

at::Tensor segment_amax(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& lengths) {
  check_flat(x, "segment_amax");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "segment_amax: float32 input expected, got ", x.scalar_type());
  const SegmentTable t = make_table(offsets, lengths, x.numel(), false, "segment_amax");
  std::vector<uint32_t> part(t.items.size());
  const float* base = x.data_ptr<float>();
  for_each_item(t, [&](int64_t k) {
    const Item& it = t.items[k];
    part[k] = amax_bits(base + it.begin, it.end - it.begin);
  });
  at::Tensor out = at::empty({t.size()}, x.options());
  float* o = out.data_ptr<float>();
  for (int64_t seg = 0; seg < t.size(); ++seg) {
    uint32_t m = 0;  // an empty segment's amax is 0
    for (int64_t k = t.first_item[seg]; k < t.first_item[seg + 1]; ++k) m = part[k] > m ? part[k] : m;
    o[seg] = float_of(m);
  }
  return out;
}

}  // namespace mfsdp2
