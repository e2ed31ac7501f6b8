// Matrix products with weight-only int4 and int8 weights: int4 for any batch (decode rows and
// prompt chunks), int8 (the LM head under quantized weights) for decode batches of a few rows.
//
// int4 (GGUF's Q4_1 numbers): groups of 32 input weights, W = code * scale + minimum, code 0..15.
// The kernel dots x with the biased codes 128 + code: a nibble ORed into 0x4300 is that number in
// bfloat16, so codes become bf16 in one logic op each. Hence each group keeps its scale and the
// offset minimum - 128 * scale:
//   y = sum_g scale_g * (sum_{k in g} (128 + code_k) * x_k) + sum_g offset_g * (sum_{k in g} x_k)
// The group sums of x are taken once per call. The weights are packed by block of 16 output rows
// (out_features is a multiple of 16), so that one vector holds 16 rows' weights for two adjacent
// inputs, the operand layout of `vdpbf16ps` with x's pair of inputs broadcast to every lane:
//   codes   uint8 [blocks, groups, 256]: for q = 0..7, bytes 32q + 2r + e (row r of the block,
//           e = 0, 1) hold the code of input 32g + 4q + e in the low nibble, of input 32g + 4q + 2 + e
//           in the high one, so one 32-byte load unpacks to two vectors (inputs 4q, 4q+1 and
//           4q+2, 4q+3 of the group);
//   scales, offsets  float32 [blocks, groups, 16]: one vector per block and group.
// A tile of up to 8 rows of x times one block accumulates every group's dot products in 16 lanes
// (no horizontal sums), each unpacked weight vector serving all the tile's rows, then scales them
// and adds the offsets' term: one pass over the weights per 8 rows of x. With avx512_bf16,
// `vdpbf16ps` multiplies exactly and sums in float32; elsewhere a portable loop does the same
// arithmetic in float32.
//
// int8: W = qweight * scale per output row; y = scale * sum_k qweight_k * x_k, codes widened to
// float32 and fused-multiply-added with x in float32, up to 4 rows of x sharing each weight row.
//
// Both parallelize over output rows with at::parallel_for (torch's thread count), 16 rows a block.
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_QUANT_AVX512 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 16;                       // output rows a block packs together
constexpr int64_t kBlockGroupBytes = kRowBlock * kGroup / 2;  // one block's codes of one group: 256
constexpr int64_t kMaxTile = 4;                         // int8_gemv: rows of x that share one weight row
constexpr int64_t kMmTile = 8;                          // int4_mm, int8_mm: rows of x per pass over a block
constexpr float kCodeBias = 128.f;                      // bf16 0x4300 | code == 128 + code

struct Int4Shape {
  int64_t rows_x, in_features, blocks, groups;
};

Int4Shape check_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(codes, "codes");
  check_cpu_contiguous(scales, "scales");
  check_cpu_contiguous(offsets, "offsets");
  TORCH_CHECK(x.dim() == 2, "int4_mm: x must be 2-D [rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int4_mm: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == kBlockGroupBytes,
              "int4_mm: codes must be uint8 [out_features / 16, groups, 256], got ", codes.scalar_type(),
              codes.sizes());
  const int64_t blocks = codes.size(0), groups = codes.size(1);
  for (const auto& [t, name] : {std::pair{&scales, "scales"}, std::pair{&offsets, "offsets"}})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({blocks, groups, kRowBlock}),
                "int4_mm: ", name, " must be float32 [", blocks, ", ", groups, ", ", kRowBlock, "], got ",
                t->scalar_type(), t->sizes());
  TORCH_CHECK(x.size(1) == groups * kGroup, "int4_mm: x has ", x.size(1), " columns; these codes take ",
              groups * kGroup);
  return {x.size(0), x.size(1), blocks, groups};
}

// Each row's sum of x over each group of 32 inputs, [rows, groups], in float32.
std::vector<float> group_sums(const at::BFloat16* x, const Int4Shape& s) {
  std::vector<float> sums(s.rows_x * s.groups);
  for (int64_t m = 0; m < s.rows_x; ++m)
    for (int64_t g = 0; g < s.groups; ++g) {
      const at::BFloat16* src = x + m * s.in_features + g * kGroup;
      float sum = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) sum += static_cast<float>(src[j]);
      sums[m * s.groups + g] = sum;
    }
  return sums;
}

struct Int4Args {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  const at::BFloat16* x;
  const float* sums;  // group_sums
  Int4Shape s;
  at::BFloat16* y;
};

void int4_block_portable(const Int4Args& a, int64_t b) {
  const Int4Shape& s = a.s;
  const int64_t out_features = s.blocks * kRowBlock;
  for (int64_t m = 0; m < s.rows_x; ++m) {
    const at::BFloat16* xm = a.x + m * s.in_features;
    float total[kRowBlock] = {};
    for (int64_t g = 0; g < s.groups; ++g) {
      const uint8_t* codes = a.codes + (b * s.groups + g) * kBlockGroupBytes;
      float dot[kRowBlock] = {};
      for (int64_t q = 0; q < kGroup / 4; ++q)
        for (int64_t j = 0; j < 2 * kRowBlock; ++j) {
          const uint8_t byte = codes[q * 2 * kRowBlock + j];
          const int64_t k = g * kGroup + 4 * q + j % 2;
          dot[j / 2] += (kCodeBias + static_cast<float>(byte & 0xF)) * static_cast<float>(xm[k]);
          dot[j / 2] += (kCodeBias + static_cast<float>(byte >> 4)) * static_cast<float>(xm[k + 2]);
        }
      const float* scales = a.scales + (b * s.groups + g) * kRowBlock;
      const float* offsets = a.offsets + (b * s.groups + g) * kRowBlock;
      for (int64_t r = 0; r < kRowBlock; ++r) total[r] += scales[r] * dot[r] + offsets[r] * a.sums[m * s.groups + g];
    }
    for (int64_t r = 0; r < kRowBlock; ++r)
      a.y[m * out_features + b * kRowBlock + r] = static_cast<at::BFloat16>(total[r]);
  }
}

#ifdef TANDEM_QUANT_AVX512
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

template <int Rows, typename Tile>
inline void last_tile(int64_t left, int64_t m, Tile& tile) {
  if constexpr (Rows > 0) {
    if (left == Rows) tile(std::integral_constant<int, Rows>{}, m);
    else last_tile<Rows - 1>(left, m, tile);
  }
}

// Rows [0, rows) of x in tiles of MaxTile, the rest as one smaller tile: `tile(n, m)` gets the
// tile's row count n as a compile-time constant (the kernels keep a tile's sums in registers).
template <int MaxTile, typename Tile>
inline void for_row_tiles(int64_t rows, Tile&& tile) {
  int64_t m = 0;
  for (; m + MaxTile <= rows; m += MaxTile) tile(std::integral_constant<int, MaxTile>{}, m);
  last_tile<MaxTile - 1>(rows - m, m, tile);
}

// Block b's 16 outputs for x rows [m0, m0 + Tile): per group, 16 lanes of dot products with the
// biased codes, each unpacked weight vector used by every row of the tile; then scale and offset.
template <int Tile>
void int4_block_tile(const Int4Args& a, int64_t b, int64_t m0) {
  const Int4Shape& s = a.s;
  const __m512i low_nibble = _mm512_set1_epi16(0xF), bias = _mm512_set1_epi16(0x4300);
  __m512 total[Tile];
  for (int t = 0; t < Tile; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < s.groups; ++g) {
    const uint8_t* codes = a.codes + (b * s.groups + g) * kBlockGroupBytes;
    __m512 dot[Tile];
    for (int t = 0; t < Tile; ++t) dot[t] = _mm512_setzero_ps();
    for (int64_t q = 0; q < kGroup / 4; ++q) {
      const __m512i bytes =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 2 * kRowBlock)));
      const __m512bh low = (__m512bh)_mm512_ternarylogic_epi32(bytes, low_nibble, bias, 0xEA);  // (a & b) | c
      const __m512bh high = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(bytes, 4), bias);
      for (int t = 0; t < Tile; ++t) {
        const int32_t* pairs = reinterpret_cast<const int32_t*>(a.x + (m0 + t) * s.in_features + g * kGroup + 4 * q);
        dot[t] = _mm512_dpbf16_ps(dot[t], low, (__m512bh)_mm512_set1_epi32(pairs[0]));
        dot[t] = _mm512_dpbf16_ps(dot[t], high, (__m512bh)_mm512_set1_epi32(pairs[1]));
      }
    }
    const __m512 scale = _mm512_loadu_ps(a.scales + (b * s.groups + g) * kRowBlock);
    const __m512 offset = _mm512_loadu_ps(a.offsets + (b * s.groups + g) * kRowBlock);
    for (int t = 0; t < Tile; ++t) {
      total[t] = _mm512_fmadd_ps(dot[t], scale, total[t]);
      total[t] = _mm512_fmadd_ps(_mm512_set1_ps(a.sums[(m0 + t) * s.groups + g]), offset, total[t]);
    }
  }
  const int64_t out_features = s.blocks * kRowBlock;
  for (int t = 0; t < Tile; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + (m0 + t) * out_features + b * kRowBlock),
                        (__m256i)_mm512_cvtneps_pbh(total[t]));
}

void int4_block_avx512(const Int4Args& a, int64_t b) {
  for_row_tiles<kMmTile>(a.s.rows_x, [&](auto rows, int64_t m) { int4_block_tile<decltype(rows)::value>(a, b, m); });
}
#endif

using Int4Block = void (*)(const Int4Args&, int64_t);

at::Tensor int4_mm_with(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& offsets, Int4Block block) {
  const Int4Shape s = check_int4(x, codes, scales, offsets);
  const std::vector<float> sums = group_sums(x.data_ptr<at::BFloat16>(), s);
  at::Tensor y = at::empty({s.rows_x, s.blocks * kRowBlock}, x.options());
  const Int4Args a{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(),
                   x.data_ptr<at::BFloat16>(), sums.data(), s, y.data_ptr<at::BFloat16>()};
  at::parallel_for(0, s.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block(a, b);
  });
  return y;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets) {
#ifdef TANDEM_QUANT_AVX512
  return int4_mm_with(x, codes, scales, offsets, int4_block_avx512);
#else
  return int4_mm_with(x, codes, scales, offsets, int4_block_portable);
#endif
}

at::Tensor int4_mm_portable(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets) {
  return int4_mm_with(x, codes, scales, offsets, int4_block_portable);
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
    for_row_tiles<kMaxTile>(s.rows_x, [&](auto rows, int64_t m) {
      int8_block_tile<T, decltype(rows)::value>(w, scales, x, s, y, n, count, m);
    });
  }
}
#endif

// ---- int8 for bfloat16 activations, packed by 16-row block: a matrix kernel like int4_mm's ----
//
// codes int8 [out / 16, in / 2, 32]: for input pair p, byte 2r + e holds row r's code at input
// 2p + e, so 32 bytes widen to one vdpbf16ps operand (int8 codes are exact in bfloat16); scales
// float32 [out / 16, 16]. A tile of up to 8 rows of x shares each converted weight vector.

struct Int8BlockArgs {
  const int8_t* codes;
  const float* scales;
  const at::BFloat16* x;
  int64_t rows_x, in_features, blocks;
  at::BFloat16* y;
};

void int8_block_portable(const Int8BlockArgs& a, int64_t b) {
  const int64_t pairs = a.in_features / 2, out_features = a.blocks * kRowBlock;
  for (int64_t m = 0; m < a.rows_x; ++m) {
    const at::BFloat16* xm = a.x + m * a.in_features;
    float dot[kRowBlock] = {};
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < 2 * kRowBlock; ++j)
        dot[j / 2] += static_cast<float>(a.codes[(b * pairs + p) * 2 * kRowBlock + j]) * static_cast<float>(xm[2 * p + j % 2]);
    for (int64_t r = 0; r < kRowBlock; ++r)
      a.y[m * out_features + b * kRowBlock + r] = static_cast<at::BFloat16>(dot[r] * a.scales[b * kRowBlock + r]);
  }
}

#ifdef TANDEM_QUANT_AVX512
// One input pair's 32 codes (16 rows x 2 inputs) as bfloat16: exact, as |code| <= 127.
inline __m512bh int8_pair_weights(const int8_t* w) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 high =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kRowBlock))));
  return _mm512_cvtne2ps_pbh(high, low);
}

// Block b's 16 outputs for x rows [m0, m0 + Tile); a tile of fewer than 4 rows alternates two
// accumulators per row so the dot products' chains overlap.
template <int Tile>
void int8_block_mm_tile(const Int8BlockArgs& a, int64_t b, int64_t m0) {
  constexpr int kChains = Tile < 4 ? 2 : 1;
  const int64_t pairs = a.in_features / 2;
  const int8_t* codes = a.codes + b * pairs * 2 * kRowBlock;
  __m512 dot[kChains][Tile];
  for (int c = 0; c < kChains; ++c)
    for (int t = 0; t < Tile; ++t) dot[c][t] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + kChains <= pairs; p += kChains)
    for (int c = 0; c < kChains; ++c) {
      const int8_t* w = codes + (p + c) * 2 * kRowBlock;
      const __m512bh weights = int8_pair_weights(w);
      for (int t = 0; t < Tile; ++t) {
        const int32_t pair = *reinterpret_cast<const int32_t*>(a.x + (m0 + t) * a.in_features + 2 * (p + c));
        dot[c][t] = _mm512_dpbf16_ps(dot[c][t], weights, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  for (; p < pairs; ++p) {  // an odd pair count's last pair
    const int8_t* w = codes + p * 2 * kRowBlock;
    const __m512bh weights = int8_pair_weights(w);
    for (int t = 0; t < Tile; ++t) {
      const int32_t pair = *reinterpret_cast<const int32_t*>(a.x + (m0 + t) * a.in_features + 2 * p);
      dot[0][t] = _mm512_dpbf16_ps(dot[0][t], weights, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  const __m512 scale = _mm512_loadu_ps(a.scales + b * kRowBlock);
  const int64_t out_features = a.blocks * kRowBlock;
  for (int t = 0; t < Tile; ++t) {
    __m512 sum = dot[0][t];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, dot[c][t]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + (m0 + t) * out_features + b * kRowBlock),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sum, scale)));
  }
}

void int8_block_avx512(const Int8BlockArgs& a, int64_t b) {
  for_row_tiles<kMmTile>(a.rows_x, [&](auto rows, int64_t m) { int8_block_mm_tile<decltype(rows)::value>(a, b, m); });
}
#endif

using Int8Block = void (*)(const Int8BlockArgs&, int64_t);

at::Tensor int8_mm_with(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, Int8Block block) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(codes, "codes");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_mm: x must be bfloat16 [rows, in_features], got ",
              x.scalar_type(), x.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(2) == 2 * kRowBlock,
              "int8_mm: codes must be int8 [out_features / 16, in_features / 2, 32], got ", codes.scalar_type(),
              codes.sizes());
  const int64_t blocks = codes.size(0);
  TORCH_CHECK(x.size(1) == 2 * codes.size(1), "int8_mm: x has ", x.size(1), " columns; these codes take ",
              2 * codes.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.sizes() == at::IntArrayRef({blocks, kRowBlock}),
              "int8_mm: scales must be float32 [", blocks, ", ", kRowBlock, "], got ", scales.scalar_type(),
              scales.sizes());
  at::Tensor y = at::empty({x.size(0), blocks * kRowBlock}, x.options());
  const Int8BlockArgs a{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), x.data_ptr<at::BFloat16>(), x.size(0),
                        x.size(1), blocks, y.data_ptr<at::BFloat16>()};
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block(a, b);
  });
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
#ifdef TANDEM_QUANT_AVX512
  return int8_mm_with(x, codes, scales, int8_block_avx512);
#else
  return int8_mm_with(x, codes, scales, int8_block_portable);
#endif
}

at::Tensor int8_mm_portable(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return int8_mm_with(x, codes, scales, int8_block_portable);
}

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
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scales, Tensor offsets) -> Tensor", int4_mm);
  m.def("int4_mm_portable(Tensor x, Tensor codes, Tensor scales, Tensor offsets) -> Tensor", int4_mm_portable);
  m.def("int8_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor", int8_mm);
  m.def("int8_mm_portable(Tensor x, Tensor codes, Tensor scales) -> Tensor", int8_mm_portable);
  m.def("int8_gemv(Tensor x, Tensor qweight, Tensor scales) -> Tensor", int8_gemv);
  m.def("int8_gemv_portable(Tensor x, Tensor qweight, Tensor scales) -> Tensor", int8_gemv_portable);
}

}  // namespace tandem
