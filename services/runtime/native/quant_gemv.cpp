// Matrix-vector products with weight-only int4 and int8 weights, for decode batches of a few rows.
//
// int4 (GGUF's Q4_1 numbers): groups of 32 input weights, W = code * scale + minimum, code 0..15.
// A row keeps its groups' codes two to a byte, 16 bytes a group: byte j holds code j in its low
// nibble and code j + 16 in its high one; the group count is padded to even with zero groups so the
// kernel reads two groups (32 bytes) at a time. The kernel dots x with the biased codes 128 + code:
// a nibble ORed into 0x4300 is that number in bfloat16, so codes become bf16 in one logic op each.
// Hence each group keeps its scale ([out, groups], float32) and the offset minimum - 128 * scale
// (float32 [out / 16 rounded up, groups, 16]: a block of 16 output rows reads its groups' offsets
// as one vector each, and every weight tensor as one sequential stream):
//   y = sum_g scale_g * (sum_{k in g} (128 + code_k) * x_k) + sum_g offset_g * (sum_{k in g} x_k)
// The group sums of x are taken once per call. With avx512_bf16, `vdpbf16ps` multiplies exactly and
// sums in float32; elsewhere a portable loop does the same arithmetic in float32.
//
// int8: W = qweight * scale per output row; y = scale * sum_k qweight_k * x_k, codes widened to
// float32 and fused-multiply-added with x in float32.
//
// Both parallelize over output rows with at::parallel_for (torch's thread count), 16 rows a block,
// and take x's rows in tiles of up to 4 that share each load (and unpacking) of a weight row.
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_QUANT_AVX512 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kGroup / 2;
constexpr int64_t kMaxTile = 4;   // rows of x that share one unpacking of a weight row
constexpr int64_t kRowBlock = 16;  // output rows a task writes together (one vector of offsets)
constexpr float kCodeBias = 128.f;  // bf16 0x4300 | code == 128 + code

struct Int4Shape {
  int64_t rows_x, in_features, out_features, groups;  // groups: padded to even
};

Int4Shape check_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(codes, "codes");
  check_cpu_contiguous(scales, "scales");
  check_cpu_contiguous(offsets, "offsets");
  TORCH_CHECK(x.dim() == 2, "int4_gemv: x must be 2-D [rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int4_gemv: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) % (2 * kGroupBytes) == 0,
              "int4_gemv: codes must be uint8 [out_features, groups * 16] with an even group count, got ",
              codes.scalar_type(), codes.sizes());
  const int64_t out_features = codes.size(0), groups = codes.size(1) / kGroupBytes;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.sizes() == at::IntArrayRef({out_features, groups}),
              "int4_gemv: scales must be float32 [", out_features, ", ", groups, "], got ", scales.scalar_type(),
              scales.sizes());
  const int64_t blocks = (out_features + kRowBlock - 1) / kRowBlock;
  TORCH_CHECK(offsets.scalar_type() == at::kFloat &&
                  offsets.sizes() == at::IntArrayRef({blocks, groups, kRowBlock}),
              "int4_gemv: offsets must be float32 [", blocks, ", ", groups, ", ", kRowBlock, "], got ",
              offsets.scalar_type(), offsets.sizes());
  const int64_t in_features = x.size(1);
  TORCH_CHECK(in_features % kGroup == 0 && (in_features / kGroup + 1) / 2 * 2 == groups,
              "int4_gemv: x has ", in_features, " columns; these codes take ", groups * kGroup,
              " (a multiple of 32, padded to an even group count)");
  return {x.size(0), in_features, out_features, groups};
}

// x as the kernels read it: per row, pairs of groups laid out as the unpacked codes come
// ([first halves of groups 2p and 2p+1], [second halves]), zero-padded, and each group's sum.
struct Int4Activations {
  std::vector<at::BFloat16> paired;  // [rows, groups * 32]
  std::vector<float> group_sums;     // [rows, groups]
};

Int4Activations prepare_int4(const at::BFloat16* x, const Int4Shape& s) {
  Int4Activations a{std::vector<at::BFloat16>(s.rows_x * s.groups * kGroup, at::BFloat16(0.f)),
                    std::vector<float>(s.rows_x * s.groups, 0.f)};
  for (int64_t m = 0; m < s.rows_x; ++m) {
    for (int64_t g = 0; g < s.in_features / kGroup; ++g) {
      const at::BFloat16* src = x + m * s.in_features + g * kGroup;
      at::BFloat16* pair = a.paired.data() + m * s.groups * kGroup + (g / 2) * 2 * kGroup + (g % 2) * kGroupBytes;
      float sum = 0.f;
      for (int64_t j = 0; j < kGroupBytes; ++j) {
        pair[j] = src[j];
        pair[kGroup + j] = src[kGroupBytes + j];
        sum += static_cast<float>(src[j]) + static_cast<float>(src[kGroupBytes + j]);
      }
      a.group_sums[m * s.groups + g] = sum;
    }
  }
  return a;
}

struct Int4Weights {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
};

void int4_rows_portable(const Int4Weights& w, const Int4Activations& a, const Int4Shape& s, at::BFloat16* y,
                        int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.codes + n * s.groups * kGroupBytes;
    for (int64_t m = 0; m < s.rows_x; ++m) {
      const at::BFloat16* xp = a.paired.data() + m * s.groups * kGroup;
      float total = 0.f;
      for (int64_t g = 0; g < s.groups; ++g) {
        const at::BFloat16* low = xp + (g / 2) * 2 * kGroup + (g % 2) * kGroupBytes;
        float dot = 0.f;
        for (int64_t j = 0; j < kGroupBytes; ++j) {
          const uint8_t byte = row[g * kGroupBytes + j];
          dot += (kCodeBias + static_cast<float>(byte & 0xF)) * static_cast<float>(low[j]);
          dot += (kCodeBias + static_cast<float>(byte >> 4)) * static_cast<float>(low[kGroup + j]);
        }
        const float offset = w.offsets[((n / kRowBlock) * s.groups + g) * kRowBlock + n % kRowBlock];
        total += w.scales[n * s.groups + g] * dot + offset * a.group_sums[m * s.groups + g];
      }
      y[m * s.out_features + n] = static_cast<at::BFloat16>(total);
    }
  }
}

#ifdef TANDEM_QUANT_AVX512
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

// Per lane, sum_g scale_g * sum_{k in g} (128 + code_k) * x_k for one output row and `Tile` rows of
// x from `xp` on.
template <int Tile>
void int4_dots(const uint8_t* row, const float* scales, const at::BFloat16* xp, const Int4Shape& s, __m512* acc) {
  const __m512i low_nibble = _mm512_set1_epi16(0xF), bias = _mm512_set1_epi16(0x4300);
  const __m512i pair_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const int64_t stride = s.groups * kGroup;
  for (int t = 0; t < Tile; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < s.groups / 2; ++p) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * 32)));
    const __m512bh low = (__m512bh)_mm512_ternarylogic_epi32(bytes, low_nibble, bias, 0xEA);  // (a & b) | c
    const __m512bh high = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
    const __m512 scale = _mm512_permutexvar_ps(pair_index, _mm512_castps128_ps512(
        _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + 2 * p)))));
    for (int t = 0; t < Tile; ++t) {
      const at::BFloat16* xt = xp + t * stride + p * 2 * kGroup;
      __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), low, (__m512bh)_mm512_loadu_si512(xt));
      dot = _mm512_dpbf16_ps(dot, high, (__m512bh)_mm512_loadu_si512(xt + kGroup));
      acc[t] = _mm512_fmadd_ps(dot, scale, acc[t]);
    }
  }
}

// Output rows [n0, n0 + count) (count <= 16) for x rows [m0, m0 + Tile): each row's dot product,
// then the offsets' term and the rounding to bf16 as one vector per x row.
template <int Tile>
void int4_block_tile(const Int4Weights& w, const Int4Activations& a, const Int4Shape& s, at::BFloat16* y,
                     int64_t n0, int64_t count, int64_t m0) {
  const at::BFloat16* xp = a.paired.data() + m0 * s.groups * kGroup;
  alignas(64) float sums[Tile][kRowBlock] = {};
  for (int64_t r = 0; r < count; ++r) {
    __m512 acc[Tile];
    int4_dots<Tile>(w.codes + (n0 + r) * s.groups * kGroupBytes, w.scales + (n0 + r) * s.groups, xp, s, acc);
    for (int t = 0; t < Tile; ++t) sums[t][r] = _mm512_reduce_add_ps(acc[t]);
  }
  const __mmask16 mask = first_lanes(count);
  const float* offsets = w.offsets + (n0 / kRowBlock) * s.groups * kRowBlock;
  for (int t = 0; t < Tile; ++t) {
    const float* group_sums = a.group_sums.data() + (m0 + t) * s.groups;
    __m512 total = _mm512_load_ps(sums[t]);
    for (int64_t g = 0; g < s.groups; ++g)
      total = _mm512_fmadd_ps(_mm512_set1_ps(group_sums[g]), _mm512_loadu_ps(offsets + g * kRowBlock), total);
    _mm256_mask_storeu_epi16(y + (m0 + t) * s.out_features + n0, mask, (__m256i)_mm512_cvtneps_pbh(total));
  }
}

void int4_rows_avx512(const Int4Weights& w, const Int4Activations& a, const Int4Shape& s, at::BFloat16* y,
                      int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kRowBlock) {
    const int64_t count = std::min(kRowBlock, n1 - n);
    int64_t m = 0;
    for (; m + kMaxTile <= s.rows_x; m += kMaxTile) int4_block_tile<kMaxTile>(w, a, s, y, n, count, m);
    switch (s.rows_x - m) {
      case 3: int4_block_tile<3>(w, a, s, y, n, count, m); break;
      case 2: int4_block_tile<2>(w, a, s, y, n, count, m); break;
      case 1: int4_block_tile<1>(w, a, s, y, n, count, m); break;
      default: break;
    }
  }
}
#endif

using Int4Rows = void (*)(const Int4Weights&, const Int4Activations&, const Int4Shape&, at::BFloat16*, int64_t,
                          int64_t);

at::Tensor int4_gemv_with(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& offsets, Int4Rows rows) {
  const Int4Shape s = check_int4(x, codes, scales, offsets);
  const Int4Activations a = prepare_int4(x.data_ptr<at::BFloat16>(), s);
  const Int4Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>()};
  at::Tensor y = at::empty({s.rows_x, s.out_features}, x.options());
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  // Tasks start on 16-row boundaries so each writes whole blocks.
  const int64_t blocks = (s.out_features + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    rows(w, a, s, out, b0 * kRowBlock, std::min(b1 * kRowBlock, s.out_features));
  });
  return y;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets) {
#ifdef TANDEM_QUANT_AVX512
  return int4_gemv_with(x, codes, scales, offsets, int4_rows_avx512);
#else
  return int4_gemv_with(x, codes, scales, offsets, int4_rows_portable);
#endif
}

at::Tensor int4_gemv_portable(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets) {
  return int4_gemv_with(x, codes, scales, offsets, int4_rows_portable);
}

// ---- int8, one scale per output row ----

struct Int8Shape {
  int64_t rows_x, in_features, out_features;
};

template <typename T>
void int8_rows_portable(const int8_t* w, const T* scales, const float* x, const Int8Shape& s, T* y, int64_t n0,
                        int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * s.in_features;
    for (int64_t m = 0; m < s.rows_x; ++m) {
      const float* xm = x + m * s.in_features;
      float dot = 0.f;
      for (int64_t k = 0; k < s.in_features; ++k) dot += static_cast<float>(row[k]) * xm[k];
      y[m * s.out_features + n] = static_cast<T>(dot * static_cast<float>(scales[n]));
    }
  }
}

#ifdef TANDEM_QUANT_AVX512
// sum_k qweight_k * x_k for one output row and `Tile` rows of x, into sums[t * kRowBlock].
template <int Tile>
void int8_dots(const int8_t* row, const float* x, const Int8Shape& s, float* sums) {
  __m512 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < s.in_features; k += 16) {
    const __mmask16 mask = first_lanes(s.in_features - k);
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row + k)));
    for (int t = 0; t < Tile; ++t)
      acc[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask, x + t * s.in_features + k), acc[t]);
  }
  for (int t = 0; t < Tile; ++t) sums[t * kRowBlock] = _mm512_reduce_add_ps(acc[t]);
}

template <typename T, int Tile>
void int8_block_tile(const int8_t* qweight, const T* scales, const float* x, const Int8Shape& s, T* y, int64_t n0,
                     int64_t count, int64_t m0) {
  alignas(64) float sums[Tile][kRowBlock] = {};
  for (int64_t r = 0; r < count; ++r)
    int8_dots<Tile>(qweight + (n0 + r) * s.in_features, x + m0 * s.in_features, s, &sums[0][r]);
  for (int t = 0; t < Tile; ++t)
    for (int64_t i = 0; i < count; ++i)
      y[(m0 + t) * s.out_features + n0 + i] = static_cast<T>(sums[t][i] * static_cast<float>(scales[n0 + i]));
}

template <typename T>
void int8_rows_avx512(const int8_t* w, const T* scales, const float* x, const Int8Shape& s, T* y, int64_t n0,
                      int64_t n1) {
  for (int64_t n = n0; n < n1; n += kRowBlock) {
    const int64_t count = std::min(kRowBlock, n1 - n);
    int64_t m = 0;
    for (; m + kMaxTile <= s.rows_x; m += kMaxTile) int8_block_tile<T, kMaxTile>(w, scales, x, s, y, n, count, m);
    switch (s.rows_x - m) {
      case 3: int8_block_tile<T, 3>(w, scales, x, s, y, n, count, m); break;
      case 2: int8_block_tile<T, 2>(w, scales, x, s, y, n, count, m); break;
      case 1: int8_block_tile<T, 1>(w, scales, x, s, y, n, count, m); break;
      default: break;
    }
  }
}
#endif

at::Tensor int8_gemv_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, bool portable) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qweight, "qweight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1),
              "int8_gemv: x [rows, in_features] and qweight [out_features, in_features] must agree, got ", x.sizes(),
              " and ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == at::kChar, "int8_gemv: qweight must be int8, got ", qweight.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0),
              "int8_gemv: scales must be [", qweight.size(0), "], got ", scales.sizes());
  check_same_dtype(x, scales, "int8_gemv: x and scales");
  const Int8Shape s{x.size(0), x.size(1), qweight.size(0)};
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({s.rows_x, s.out_features}, x.options());
  TANDEM_DISPATCH(x.scalar_type(), "int8_gemv", [&] {
    const int8_t* w = qweight.data_ptr<int8_t>();
    const scalar_t* sc = scales.data_ptr<scalar_t>();
    const float* xp = xf.data_ptr<float>();
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, s.out_features, 64, [&](int64_t n0, int64_t n1) {
#ifdef TANDEM_QUANT_AVX512
      if (!portable) return int8_rows_avx512<scalar_t>(w, sc, xp, s, out, n0, n1);
#endif
      int8_rows_portable<scalar_t>(w, sc, xp, s, out, n0, n1);
    });
  });
  return y;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return int8_gemv_impl(x, qweight, scales, false);
}

at::Tensor int8_gemv_portable(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return int8_gemv_impl(x, qweight, scales, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor offsets) -> Tensor", int4_gemv);
  m.def("int4_gemv_portable(Tensor x, Tensor codes, Tensor scales, Tensor offsets) -> Tensor", int4_gemv_portable);
  m.def("int8_gemv(Tensor x, Tensor qweight, Tensor scales) -> Tensor", int8_gemv);
  m.def("int8_gemv_portable(Tensor x, Tensor qweight, Tensor scales) -> Tensor", int8_gemv_portable);
}

}  // namespace tandem
