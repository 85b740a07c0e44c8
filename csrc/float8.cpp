// float32 -> float8 quantisation (scale, clamp, round) in one pass, and the per-segment byte
// lookup that dequantises. In torch (CPU) the quantise is three passes with a temporary
// (multiply, clamp, cast) and the float8 -> float32 cast converts one element at a time; these
// loops are branch-free and vectorised by the compiler.
#include "float8.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <vector>

#include "segments.h"
#include "simd.h"

namespace mfsdp2 {
namespace {

// Round |v| (the float32 word ``a`` with the sign cleared: a clamped value or NaN) to float8
// bits, ties to even, for a format with kMant mantissa bits and exponent bias kBias:
// * normal results: add the rounding increment below the kept mantissa bits of the float32
//   word (half an ulp minus one, plus the kept lsb: ties go to even), shift, re-bias; a carry
//   out of the mantissa moves into the exponent, which is what rounding up to a power of two is;
// * subnormal results (|v| below the format's smallest normal 2^(1-kBias)): the result is the
//   integer round(|v| * 2^(kMant + kBias - 1)) in [0, 2^kMant]; |v| times a power of two is exact,
//   and adding 2^23 makes the float adder round it to an integer (to nearest even) in the low
//   bits of the word. 2^kMant itself encodes the smallest normal, as it should.
template <int kMant, int kBias>
inline uint32_t fp8_magnitude(uint32_t a) {
  constexpr int kDrop = 23 - kMant;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << kMant;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr float kSubScale = static_cast<float>(1u << (kMant + kBias - 1));
  const uint32_t normal = ((a + ((1u << (kDrop - 1)) - 1u) + ((a >> kDrop) & 1u)) >> kDrop) - kRebias;
  const uint32_t sub = bits_of(float_of(a) * kSubScale + 8388608.0f) - 0x4B000000u;
  return static_cast<int32_t>(a) < static_cast<int32_t>(kMinNormal) ? sub : normal;  // signed: SSE2 has no unsigned compare
}

// x * s, clamped to [-max, max] (the reference's two float32 operations; a NaN passes both
// comparisons unchanged, as torch.clamp lets it through), rounded to float8 bits.
// float8_e4m3fn has no infinities: torch 2.13 saturates to 448 (0x7E) what would round past it;
// float8_e5m2 rounds 61440 and above to infinity (0x7C). NaN is 0x7F, with the input's sign.
template <bool kE5M2>
inline uint8_t quantise1(float x, float s, float max) {
  float v = x * s;
  v = v > max ? max : v;
  v = v < -max ? -max : v;
  const uint32_t u = bits_of(v);
  const uint32_t a = u & 0x7FFFFFFFu;
  const int32_t sa = static_cast<int32_t>(a);  // a < 2^31: signed compares (SSE2 has no unsigned ones)
  uint32_t r;
  if constexpr (kE5M2) {
    r = fp8_magnitude<2, 15>(a);
    r = sa >= 0x47700000 ? 0x7Cu : r;
  } else {
    r = fp8_magnitude<3, 7>(a);
    r = sa > 0x43E00000 ? 0x7Eu : r;
  }
  r = sa > 0x7F800000 ? 0x7Fu : r;
  return static_cast<uint8_t>(r | ((u >> 24) & 0x80u));
}

template <bool kE5M2>
MFSDP2_CLONES void quantise(const float* __restrict x, uint8_t* __restrict q, int64_t n, float s, float max) {
  for (int64_t i = 0; i < n; ++i) q[i] = quantise1<kE5M2>(x[i], s, max);
}

// dst[i] = table[src[i]]. The table entries are 32-bit even for 2-byte outputs: the compiler
// vectorises 32-bit table reads as gathers, which take about half the time of 16-bit loads here.
template <typename T>
MFSDP2_CLONES void lookup(const uint8_t* __restrict src, T* __restrict dst, const uint32_t* __restrict table, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(table[src[i]]);
}

void check_flat(const at::Tensor& x, at::ScalarType dtype, const char* what, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), what, ": ", name,
              " must be a contiguous 1-D CPU tensor, got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, what, ": ", name, " must be ", dtype, ", got ", x.scalar_type());
}

}  // namespace

void quantise_fp8(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& offsets,
                  const at::Tensor& lengths, const at::Tensor& scales, double max, bool e5m2) {
  check_flat(src, at::kFloat, "quantise_fp8", "src");
  check_flat(dst, at::kByte, "quantise_fp8", "dst");
  TORCH_CHECK(dst.numel() == src.numel(), "quantise_fp8: dst has ", dst.numel(), " elements, src ", src.numel());
  const SegmentTable t = make_table(offsets, lengths, src.numel(), "quantise_fp8");
  at::Tensor sc = scales.to(at::kFloat).contiguous();
  TORCH_CHECK(sc.device().is_cpu() && sc.numel() == t.size(), "quantise_fp8: one scale per segment expected (",
              t.size(), "), got ", sc.numel());
  const float* s = sc.data_ptr<float>();
  const float* x = src.data_ptr<float>();
  uint8_t* q = dst.data_ptr<uint8_t>();
  const float m = static_cast<float>(max);
  // Positions outside the segments (padding) are zero, as the reference's zero_() leaves them.
  int64_t pos = 0;
  for (int64_t seg = 0; seg < t.size(); ++seg) {
    if (t.lengths[seg] == 0) continue;
    std::memset(q + pos, 0, t.offsets[seg] - pos);
    pos = t.offsets[seg] + t.lengths[seg];
  }
  std::memset(q + pos, 0, dst.numel() - pos);
  for_each_item(t, [&](int64_t k) {
    const Item& it = t.items[k];
    if (e5m2)
      quantise<true>(x + it.begin, q + it.begin, it.end - it.begin, s[it.seg], m);
    else
      quantise<false>(x + it.begin, q + it.begin, it.end - it.begin, s[it.seg], m);
  });
}

void lookup_bytes(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& offsets,
                  const at::Tensor& lengths, const at::Tensor& tables) {
  check_flat(src, at::kByte, "lookup_bytes", "src");
  TORCH_CHECK(dst.device().is_cpu() && dst.dim() == 1 && dst.is_contiguous(),
              "lookup_bytes: dst must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(dst.numel() == src.numel(), "lookup_bytes: dst has ", dst.numel(), " elements, src ", src.numel());
  const SegmentTable t = make_table(offsets, lengths, src.numel(), "lookup_bytes");
  TORCH_CHECK(tables.device().is_cpu() && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == t.size() && tables.size(1) == 256 && tables.scalar_type() == dst.scalar_type(),
              "lookup_bytes: tables must be a contiguous [segments, 256] CPU tensor of dst's dtype (",
              dst.scalar_type(), "), got ", tables.sizes(), " ", tables.scalar_type());
  const int64_t width = dst.element_size();
  TORCH_CHECK(width == 2 || width == 4, "lookup_bytes: dst must have 2- or 4-byte elements, got ", dst.scalar_type());
  const uint8_t* b = src.data_ptr<uint8_t>();
  std::vector<uint32_t> wide(256 * t.size());
  for (size_t j = 0; j < wide.size(); ++j)
    wide[j] = width == 2 ? static_cast<const uint16_t*>(tables.data_ptr())[j] : static_cast<const uint32_t*>(tables.data_ptr())[j];
  for_each_item(t, [&](int64_t k) {
    const Item& it = t.items[k];
    if (width == 2)
      lookup(b + it.begin, static_cast<uint16_t*>(dst.data_ptr()) + it.begin, wide.data() + 256 * it.seg, it.end - it.begin);
    else
      lookup(b + it.begin, static_cast<uint32_t*>(dst.data_ptr()) + it.begin, wide.data() + 256 * it.seg, it.end - it.begin);
  });
}

}  // namespace mfsdp2
