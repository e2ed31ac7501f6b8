// Prefill attention: a fresh prompt chunk (no earlier context) attending causally to itself, q, k and v
// straight from the fused qkv projection's output. Replaces SDPA's CPU flash kernel for bfloat16, which
// ran a 512-token chunk (9 heads over 3 KV heads of 64) at ~27 GFLOP/s on one AMD EPYC Zen 4 core: a
// third of a prefill's time.
//
// Per KV head and block of 16 query rows (its `group` query heads sharing the KV head: 16 x group query
// vectors), in three passes:
//   scores  every query vector's dot products with the keys up to the block's last row, 16 keys at a
//           time in float32 lanes: the keys are packed once per call so one 64-byte vector holds 16
//           keys' values for two adjacent dims, the operand layout of `vdpbf16ps`, with the query's
//           pair broadcast to every lane (no horizontal sums); a tile of 8 query vectors shares each
//           key vector. Times `scale`.
//   softmax each row over its own keys 0..i (the causal mask), exp16, in float32; later keys get 0.
//   values  4 query vectors at a time sum the values (widened to float32 once per call) weighted by
//           their probabilities, in float32 fused multiply-adds; rounded to bfloat16 once, at the end.
// With avx512_bf16 and head_dim 64 or 128 for bfloat16 inputs; elsewhere (any dtype, any head_dim) a
// portable loop does the same arithmetic per row in float32. Threads take (KV head, block) tasks in
// the order first, last, second, second-to-last ... so that contiguous ranges balance causal work.
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_PREFILL_AVX512 1
#endif

#include <algorithm>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kBlock = 16;  // query rows per task, keys per score vector

struct Prefill {
  int64_t tokens, heads, kv_heads, dim, q_stride, k_stride, v_stride;
  float scale;
  int64_t group() const { return heads / kv_heads; }
  int64_t blocks() const { return (tokens + kBlock - 1) / kBlock; }
};

Prefill check_prefill_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  for (const auto& [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}}) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
                "prefill_attention: ", name, " must be a CPU [tokens, heads, head_dim] tensor with each row's "
                "heads contiguous, got sizes ", t.sizes(), " strides ", t.strides());
  }
  check_same_dtype(q, k, "prefill_attention(q, k)");
  check_same_dtype(q, v, "prefill_attention(q, v)");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "prefill_attention: k and v must be [", q.size(0), ", kv_heads, ", q.size(2), "] like q's rows, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "prefill_attention: ", q.size(1),
              " query heads do not group over ", k.size(1), " KV heads");
  return {q.size(0), q.size(1), k.size(1), q.size(2), q.stride(0), k.stride(0), v.stride(0), static_cast<float>(scale)};
}

// Task t of `count` in the order 0, count-1, 1, count-2, ...: a causal block's cost grows with its index.
inline int64_t balanced(int64_t t, int64_t count) { return t % 2 == 0 ? t / 2 : count - 1 - t / 2; }

// One query row of one head, every step in float32: the reference arithmetic, for any dtype.
template <typename T>
void attend_row_portable(const Prefill& p, const T* q, const T* k, const T* v, int64_t i, int64_t head,
                         float* scores, T* out) {
  const int64_t kv = head / p.group(), n = i + 1;
  const T* query = q + i * p.q_stride + head * p.dim;
  float max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const T* key = k + j * p.k_stride + kv * p.dim;
    float dot = 0.f;
    for (int64_t d = 0; d < p.dim; ++d) dot += static_cast<float>(query[d]) * static_cast<float>(key[d]);
    scores[j] = dot * p.scale;
    max = std::max(max, scores[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = fast_exp(scores[j] - max);
    sum += scores[j];
  }
  std::vector<float> acc(p.dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = v + j * p.v_stride + kv * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) acc[d] += scores[j] * static_cast<float>(value[d]);
  }
  T* o = out + (i * p.heads + head) * p.dim;
  for (int64_t d = 0; d < p.dim; ++d) o[d] = static_cast<T>(acc[d] / sum);
}

template <typename T>
at::Tensor prefill_portable(const Prefill& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  at::Tensor out = at::empty({p.tokens, p.heads, p.dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const T* qs = q.data_ptr<T>();
  const T* ks = k.data_ptr<T>();
  const T* vs = v.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const int64_t count = p.tokens * p.heads;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(p.tokens);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t task = balanced(t, count);
      attend_row_portable(p, qs, ks, vs, task / p.heads, task % p.heads, scores.data(), os);
    }
  });
  return out;
}

#ifdef TANDEM_PREFILL_AVX512
constexpr int64_t kScoreTile = 8;  // query vectors sharing each key vector
constexpr int64_t kValueTile = 4;  // query vectors sharing each value row

struct Packed {
  const uint32_t* keys;  // [kv_heads, blocks, dim / 2, 16]: key pairs of 16 keys, zeros past the last
  const float* values;   // [kv_heads, tokens, dim]
};

// The query vectors of a task: 16 rows x group heads, row-major within each head; rows past the last
// token repeat the last token (their results are not stored).
struct Task {
  int64_t kv, first, rows;
  const c10::BFloat16* query(const Prefill& p, const c10::BFloat16* q, int64_t r) const {
    const int64_t g = r / kBlock, row = first + std::min(r % kBlock, rows - 1);
    return q + row * p.q_stride + (kv * p.group() + g) * p.dim;
  }
};

void pack(const Prefill& p, const c10::BFloat16* k, const c10::BFloat16* v, uint16_t* keys, float* values) {
  const int64_t blocks = p.blocks(), pairs = p.dim / 2;
  at::parallel_for(0, p.kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / blocks, block = task % blocks;
      uint16_t* dst = keys + task * pairs * kBlock * 2;
      for (int64_t lane = 0; lane < kBlock; ++lane) {
        const int64_t j = block * kBlock + lane;
        const uint16_t* key = reinterpret_cast<const uint16_t*>(k + j * p.k_stride + kv * p.dim);
        for (int64_t pair = 0; pair < pairs; ++pair) {
          uint16_t* at = dst + (pair * kBlock + lane) * 2;
          at[0] = j < p.tokens ? key[2 * pair] : 0;
          at[1] = j < p.tokens ? key[2 * pair + 1] : 0;
        }
        if (j < p.tokens) {
          const c10::BFloat16* value = v + j * p.v_stride + kv * p.dim;
          float* row = values + (kv * p.tokens + j) * p.dim;
          for (int64_t d = 0; d < p.dim; d += kWidth) store16(row + d, load16(value + d));
        }
      }
    }
  });
}

// scores[r][0 .. keys) for the tile of query vectors r0 .. r0 + 8, keys rounded up to 16.
void score_tile(const Prefill& p, const Packed& packed, const Task& task, const c10::BFloat16* q, int64_t r0,
                int64_t keys, float* scores, int64_t width) {
  const int64_t pairs = p.dim / 2;
  std::vector<uint32_t> query_pairs(kScoreTile * pairs);
  for (int64_t t = 0; t < kScoreTile; ++t) {
    std::memcpy(query_pairs.data() + t * pairs, task.query(p, q, r0 + t), p.dim * sizeof(c10::BFloat16));
  }
  const __m512 scale = _mm512_set1_ps(p.scale);
  const uint32_t* head_keys = packed.keys + task.kv * p.blocks() * pairs * kBlock;
  for (int64_t block = 0; block * kBlock < keys; ++block) {
    const uint32_t* key_pairs = head_keys + block * pairs * kBlock;
    __m512 acc[kScoreTile];
    for (int64_t t = 0; t < kScoreTile; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const __m512bh key = (__m512bh)_mm512_loadu_si512(key_pairs + pair * kBlock);
      for (int64_t t = 0; t < kScoreTile; ++t) {
        const __m512bh query = (__m512bh)_mm512_set1_epi32(static_cast<int>(query_pairs[t * pairs + pair]));
        acc[t] = _mm512_dpbf16_ps(acc[t], query, key);
      }
    }
    for (int64_t t = 0; t < kScoreTile; ++t) {
      _mm512_storeu_ps(scores + (r0 + t) * width + block * kBlock, _mm512_mul_ps(acc[t], scale));
    }
  }
}

// In place over keys 0 .. n of a row (n <= width, width a multiple of 16): the probabilities,
// unnormalized, 0 from key n on; returns their sum.
float exp_row(float* row, int64_t n, int64_t width) {
  for (int64_t j = n; j < width; ++j) row[j] = -INFINITY;
  __m512 max = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < width; j += kWidth) max = _mm512_max_ps(max, _mm512_loadu_ps(row + j));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += kWidth) {
    const __mmask16 live = n - j >= kWidth ? 0xffff : static_cast<__mmask16>((1u << std::max<int64_t>(0, n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift)));
    _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// out rows of the tile r0 .. r0 + 4 (one head; rows past the last token skipped): probabilities
// times values over keys 0 .. the tile's last row, divided by each row's sum.
template <int64_t Chunks>
void value_tile(const Prefill& p, const Packed& packed, const Task& task, int64_t r0, const float* scores,
                const float* sums, int64_t width, c10::BFloat16* out) {
  const int64_t g = r0 / kBlock, row0 = r0 % kBlock;
  const int64_t live = std::min(kValueTile, task.rows - row0);
  if (live <= 0) return;
  const int64_t keys = task.first + row0 + live;
  const float* values = packed.values + task.kv * p.tokens * p.dim;
  __m512 acc[kValueTile][Chunks];
  for (int64_t t = 0; t < kValueTile; ++t)
    for (int64_t c = 0; c < Chunks; ++c) acc[t][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m512 value[Chunks];
    for (int64_t c = 0; c < Chunks; ++c) value[c] = _mm512_loadu_ps(values + j * p.dim + c * kWidth);
    for (int64_t t = 0; t < kValueTile; ++t) {
      const __m512 prob = _mm512_set1_ps(scores[(r0 + t) * width + j]);
      for (int64_t c = 0; c < Chunks; ++c) acc[t][c] = _mm512_fmadd_ps(prob, value[c], acc[t][c]);
    }
  }
  const int64_t head = task.kv * p.group() + g;
  for (int64_t t = 0; t < live; ++t) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[r0 + t]);
    c10::BFloat16* o = out + ((task.first + row0 + t) * p.heads + head) * p.dim;
    for (int64_t c = 0; c < Chunks; ++c) store16(o + c * kWidth, _mm512_mul_ps(acc[t][c], inv));
  }
}

template <int64_t Chunks>
at::Tensor prefill_avx512(const Prefill& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t blocks = p.blocks(), vectors = kBlock * p.group();
  at::Tensor keys = at::empty({p.kv_heads, blocks, p.dim / 2, kBlock * 2}, at::kShort);
  at::Tensor values = at::empty({p.kv_heads, p.tokens, p.dim}, at::kFloat);
  pack(p, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), reinterpret_cast<uint16_t*>(keys.data_ptr()),
       values.data_ptr<float>());
  const Packed packed{reinterpret_cast<const uint32_t*>(keys.data_ptr()), values.data_ptr<float>()};
  at::Tensor out = at::empty({p.tokens, p.heads, p.dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const c10::BFloat16* qs = q.data_ptr<c10::BFloat16>();
  c10::BFloat16* os = out.data_ptr<c10::BFloat16>();
  const int64_t count = p.kv_heads * blocks;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(vectors * blocks * kBlock), sums(vectors);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t index = balanced(t, count), block = index / p.kv_heads;
      const Task task{index % p.kv_heads, block * kBlock, std::min(kBlock, p.tokens - block * kBlock)};
      const int64_t keys = task.first + task.rows, width = (keys + kBlock - 1) / kBlock * kBlock;
      for (int64_t r0 = 0; r0 < vectors; r0 += kScoreTile) score_tile(p, packed, task, qs, r0, keys, scores.data(), width);
      for (int64_t r = 0; r < vectors; ++r) {
        sums[r] = exp_row(scores.data() + r * width, task.first + std::min(r % kBlock, task.rows - 1) + 1, width);
      }
      for (int64_t r0 = 0; r0 < vectors; r0 += kValueTile) {
        value_tile<Chunks>(p, packed, task, r0, scores.data(), sums.data(), width, os);
      }
    }
  });
  return out;
}
#endif

at::Tensor prefill_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  bool portable) {
  const Prefill p = check_prefill_args(q, k, v, scale);
#ifdef TANDEM_PREFILL_AVX512
  if (!portable && q.scalar_type() == at::kBFloat16 && p.dim == 64) return prefill_avx512<4>(p, q, k, v);
  if (!portable && q.scalar_type() == at::kBFloat16 && p.dim == 128) return prefill_avx512<8>(p, q, k, v);
#endif
  at::Tensor out;
  TANDEM_DISPATCH(q.scalar_type(), "prefill_attention", [&] { out = prefill_portable<scalar_t>(p, q, k, v); });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return prefill_attention_impl(q, k, v, scale, false);
}

at::Tensor prefill_attention_portable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return prefill_attention_impl(q, k, v, scale, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", prefill_attention);
  m.def("prefill_attention_portable(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", prefill_attention_portable);
}

}  // namespace tandem
