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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define MFSDP2_VBMI 1
#endif

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

#ifdef MFSDP2_VBMI
// 2-byte outputs on CPUs with AVX-512 VBMI: the table's low and high bytes each fill four zmm
// registers (256 entries); vpermi2b looks 64 indices up in 128 entries at a time, the index's
// top bit picks the half, and the two byte planes are interleaved back into 16-bit words. No
// gathers: about the speed of a copy. The same table entries, so the same bits as lookup().
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
void lookup16_vbmi(const uint8_t* __restrict src, uint16_t* __restrict dst, const uint32_t* __restrict table, int64_t n) {
  alignas(64) uint8_t lo[256], hi[256];
  for (int i = 0; i < 256; ++i) {
    lo[i] = static_cast<uint8_t>(table[i]);
    hi[i] = static_cast<uint8_t>(table[i] >> 8);
  }
  const __m512i l0 = _mm512_load_si512(lo), l1 = _mm512_load_si512(lo + 64);
  const __m512i l2 = _mm512_load_si512(lo + 128), l3 = _mm512_load_si512(lo + 192);
  const __m512i h0 = _mm512_load_si512(hi), h1 = _mm512_load_si512(hi + 64);
  const __m512i h2 = _mm512_load_si512(hi + 128), h3 = _mm512_load_si512(hi + 192);
  // unpack{lo,hi}_epi8 interleave within 128-bit lanes: words 0-7 of each lane in ``a``, 8-15 in
  // ``b``; these qword orders put the lanes back in element order.
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i idx = _mm512_loadu_si512(src + i);
    const __mmask64 top = _mm512_movepi8_mask(idx);
    const __m512i l = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(l0, idx, l1), _mm512_permutex2var_epi8(l2, idx, l3));
    const __m512i h = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(h0, idx, h1), _mm512_permutex2var_epi8(h2, idx, h3));
    const __m512i a = _mm512_unpacklo_epi8(l, h), b = _mm512_unpackhi_epi8(l, h);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi64(a, first, b));
    _mm512_storeu_si512(dst + i + 32, _mm512_permutex2var_epi64(a, second, b));
  }
  for (; i < n; ++i) dst[i] = static_cast<uint16_t>(table[src[i]]);
}
#endif

void check_flat(const at::Tensor& x, at::ScalarType dtype, const char* what, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_contiguous(), what, ": ", name,
              " must be a contiguous 1-D CPU tensor, got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, what, ": ", name, " must be ", dtype, ", got ", x.scalar_type());
}

}  // namespace

bool has_vbmi() {
#ifdef MFSDP2_VBMI
  static const bool yes = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

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
                  const at::Tensor& lengths, const at::Tensor& tables, bool allow_vbmi) {
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
  const bool vbmi = allow_vbmi && has_vbmi();
  for_each_item(t, [&](int64_t k) {
    const Item& it = t.items[k];
#ifdef MFSDP2_VBMI
    if (width == 2 && vbmi) {
      lookup16_vbmi(b + it.begin, static_cast<uint16_t*>(dst.data_ptr()) + it.begin, wide.data() + 256 * it.seg,
                    it.end - it.begin);
      return;
    }
#endif
    if (width == 2)
      lookup(b + it.begin, static_cast<uint16_t*>(dst.data_ptr()) + it.begin, wide.data() + 256 * it.seg, it.end - it.begin);
    else
      lookup(b + it.begin, static_cast<uint32_t*>(dst.data_ptr()) + it.begin, wide.data() + 256 * it.seg, it.end - it.begin);
  });
}

}  // namespace mfsdp2
