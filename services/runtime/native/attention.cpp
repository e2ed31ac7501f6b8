// Decode attention: one query row per sequence straight over its paged KV blocks (no gather copy),
// float32 scores, softmax and sums whatever the cache's dtype, grouped-query heads sharing each key
// and value row as it is read. Replaces attention.TorchAttention._decode's gather, copies, two
// batched matrix products and softmax (~14 ATen ops a layer); same math, float32 rounding order.
#include "simd.h"

#include <algorithm>
#include <vector>

namespace tandem {
namespace {

constexpr int kLanes = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

template <typename T>
inline void to_float(const T* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// In place: scores <- softmax(scores).
inline void softmax(float* scores, int64_t n) {
  float max = scores[0];
  for (int64_t t = 1; t < n; ++t) max = std::max(max, scores[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = fast_exp(scores[t] - max);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) scores[t] *= inv;
}

struct Layout {
  int64_t batch, heads, kv_heads, dim, block_size, table_width, num_blocks;
  int64_t q_row_stride;  // elements between two sequences' query rows (q may be a view into qkv)
};

Layout check_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "decode_attention: q must be a CPU [batch, heads, head_dim] tensor with each row's heads "
              "contiguous, got sizes ", q.sizes(), " strides ", q.strides());
  for (const auto& [t, name] : {std::pair{k_cache, "k_cache"}, {v_cache, "v_cache"},
                                {block_tables, "block_tables"}, {context_lens, "context_lens"}}) {
    check_cpu_contiguous(t, name);
  }
  check_same_dtype(q, k_cache, "decode_attention(q, k_cache)");
  check_same_dtype(q, v_cache, "decode_attention(q, v_cache)");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == dim && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: the caches must be [blocks, block_size, kv_heads, ", dim, "], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "decode_attention: ", heads, " query heads do not group over ", kv_heads,
              " KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == batch,
              "decode_attention: block_tables must be int64 [", batch, ", blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.numel() == batch,
              "decode_attention: context_lens must be int64 with one entry per sequence (", batch, ")");
  return {batch, heads, kv_heads, dim, k_cache.size(1), block_tables.size(1), k_cache.size(0), q.stride(0)};
}

void check_tables(const Layout& l, const int64_t* tables, const int64_t* lens) {
  for (int64_t b = 0; b < l.batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= l.table_width * l.block_size, "decode_attention: sequence ", b,
                "'s context of ", lens[b], " tokens does not fit its ", l.table_width, " blocks of ", l.block_size);
    const int64_t used = (lens[b] + l.block_size - 1) / l.block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t block = tables[b * l.table_width + i];
      TORCH_CHECK(block >= 0 && block < l.num_blocks, "decode_attention: block ", block, " is outside the ",
                  l.num_blocks, "-block cache");
    }
  }
}

inline int64_t slot_offset(const Layout& l, const int64_t* table, int64_t t, int64_t kv_head) {
  return ((table[t / l.block_size] * l.block_size + t % l.block_size) * l.kv_heads + kv_head) * l.dim;
}

// One sequence, one KV head, the `group` query heads that share it; scalar loops.
template <typename T>
void attend_scalar(const Layout& l, const T* q, const T* keys, const T* values, const int64_t* table, int64_t n,
                   int64_t kv_head, float scale, T* out) {
  const int64_t group = l.heads / l.kv_heads, dim = l.dim;
  std::vector<float> queries(group * dim), row(dim), scores(group * n), acc(group * dim, 0.f);
  for (int64_t g = 0; g < group; ++g) to_float(q + (kv_head * group + g) * dim, queries.data() + g * dim, dim);
  for (int64_t t = 0; t < n; ++t) {
    to_float(keys + slot_offset(l, table, t, kv_head), row.data(), dim);
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(queries.data() + g * dim, row.data(), dim) * scale;
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
  for (int64_t t = 0; t < n; ++t) {
    to_float(values + slot_offset(l, table, t, kv_head), row.data(), dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + t];
      float* a = acc.data() + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* o = out + (kv_head * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d]);
  }
}

#ifdef TANDEM_SIMD
constexpr int64_t kMaxChunks = 16;  // head_dim up to 256 in registers

// In place: scores <- softmax(scores), 16 at a time.
inline void softmax16(float* scores, int64_t n) {
  __m512 max = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + kWidth <= n; t += kWidth) max = _mm512_max_ps(max, _mm512_loadu_ps(scores + t));
  float m = _mm512_reduce_max_ps(max);
  for (; t < n; ++t) m = std::max(m, scores[t]);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + kWidth <= n; t += kWidth) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t), shift));
    _mm512_storeu_ps(scores + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; t < n; ++t) {
    scores[t] = fast_exp(scores[t] - m);
    total += scores[t];
  }
  const float inv = 1.f / total;
  for (t = 0; t < n; ++t) scores[t] *= inv;
}

// As `attend_scalar`, for head_dim a multiple of 16 (at most 256): a query head's or an output row's
// 16-float chunks stay in registers while the keys or values stream past.
template <typename T>
void attend_simd(const Layout& l, const T* q, const T* keys, const T* values, const int64_t* table, int64_t n,
                 int64_t kv_head, float scale, T* out) {
  const int64_t group = l.heads / l.kv_heads, chunks = l.dim / kWidth;
  std::vector<float> scores(group * n);
  for (int64_t g = 0; g < group; ++g) {
    const T* query = q + (kv_head * group + g) * l.dim;
    __m512 qv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) qv[c] = load16(query + c * kWidth);
    for (int64_t t = 0; t < n; ++t) {
      const T* key = keys + slot_offset(l, table, t, kv_head);
      __m512 acc = _mm512_mul_ps(qv[0], load16(key));
      for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], load16(key + c * kWidth), acc);
      scores[g * n + t] = _mm512_reduce_add_ps(acc) * scale;
    }
    softmax16(scores.data() + g * n, n);
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const T* value = values + slot_offset(l, table, t, kv_head);
      const __m512 p = _mm512_set1_ps(scores[g * n + t]);
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, load16(value + c * kWidth), acc[c]);
    }
    T* o = out + (kv_head * group + g) * l.dim;
    for (int64_t c = 0; c < chunks; ++c) store16(o + c * kWidth, acc[c]);
  }
}
#endif

template <typename T>
void attend(const Layout& l, const T* q, const T* keys, const T* values, const int64_t* table, int64_t n,
            int64_t kv_head, float scale, T* out) {
#ifdef TANDEM_SIMD
  if (l.dim % kWidth == 0 && l.dim <= kMaxChunks * kWidth) {
    attend_simd(l, q, keys, values, table, n, kv_head, scale, out);
    return;
  }
#endif
  attend_scalar(l, q, keys, values, table, n, kv_head, scale, out);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const Layout l = check_attention_args(q, k_cache, v_cache, block_tables, context_lens);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  check_tables(l, tables, lens);
  at::Tensor out = at::empty({l.batch, l.heads, l.dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  int64_t total_keys = 0;
  for (int64_t b = 0; b < l.batch; ++b) total_keys += lens[b];
  const int64_t tasks = l.batch * l.kv_heads;
  // About 64k multiply-adds of work (tens of microseconds) before a second thread joins.
  const int64_t work_per_task = std::max<int64_t>(1, total_keys * l.heads * l.dim * 2 / std::max<int64_t>(1, tasks));
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / work_per_task);
  TANDEM_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qs = q.data_ptr<scalar_t>();
    const scalar_t* keys = k_cache.data_ptr<scalar_t>();
    const scalar_t* values = v_cache.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / l.kv_heads, kv_head = task % l.kv_heads;
        attend(l, qs + b * l.q_row_stride, keys, values, tables + b * l.table_width, lens[b], kv_head,
               static_cast<float>(scale), os + b * l.heads * l.dim);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor",
        &decode_attention);
}

}  // namespace tandem
