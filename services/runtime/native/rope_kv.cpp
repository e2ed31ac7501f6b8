// RoPE on a step's queries and keys, in place in the fused qkv projection's output, and the keys'
// and values' write into the paged KV cache: one call for what services/runtime/model.py's `rotate`
// and attention.write_kv do in ~10 ATen ops. Rounds as `rotate` does (x*cos and swapped*sin each
// rounded to the element type, then their sum), so results equal the torch path's to the bit.
#include "common.h"

#include <vector>

namespace tandem {
namespace {

// x <- x * cos + swap_halves(x) * sin, where `sin` has its first half negated (CausalLM.sin).
template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t dim, float* scratch) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float swapped = static_cast<float>(x[i < half ? i + half : i - half]);
    const float a = round_to<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const float b = round_to<T>(swapped * static_cast<float>(sin[i]));
    scratch[i] = a + b;
  }
  for (int64_t i = 0; i < dim; ++i) x[i] = static_cast<T>(scratch[i]);
}

struct RopeArgs {
  int64_t tokens, heads, kv_heads, dim, table_rows, cache_slots;
};

RopeArgs check_rope_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slots, int64_t num_heads) {
  for (const auto& [t, name] : {std::pair{qkv, "qkv"}, {cos, "cos"}, {sin, "sin"}, {positions, "positions"},
                                {k_cache, "k_cache"}, {v_cache, "v_cache"}, {slots, "slots"}}) {
    check_cpu_contiguous(t, name);
  }
  TORCH_CHECK(qkv.dim() == 3, "rope_write_kv: qkv must be [tokens, heads + 2 * kv_heads, head_dim], got ",
              qkv.sizes());
  const int64_t dim = qkv.size(2);
  const int64_t kv_heads = (qkv.size(1) - num_heads) / 2;
  TORCH_CHECK(kv_heads >= 1 && num_heads + 2 * kv_heads == qkv.size(1), "rope_write_kv: qkv's ", qkv.size(1),
              " heads are not ", num_heads, " query heads plus twice as many key as value heads");
  TORCH_CHECK(dim % 2 == 0, "rope_write_kv: head_dim ", dim, " must be even");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == dim &&
                  v_cache.sizes() == k_cache.sizes(),
              "rope_write_kv: the caches must be [blocks, block_size, ", kv_heads, ", ", dim, "], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rope_write_kv: cos and sin must be [positions, ", dim, "]");
  for (const auto& t : {cos, sin, k_cache, v_cache}) check_same_dtype(qkv, t, "rope_write_kv");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slots.numel() == tokens,
              "rope_write_kv: positions and slots must be int64 with one entry per token (", tokens, ")");
  return {tokens, num_heads, kv_heads, dim, cos.size(0), k_cache.size(0) * k_cache.size(1)};
}

void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads) {
  const RopeArgs a = check_rope_args(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < a.tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < a.table_rows, "rope_write_kv: position ", pos[t], " is outside the ",
                a.table_rows, "-row RoPE table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < a.cache_slots, "rope_write_kv: slot ", slot[t], " is outside the ",
                a.cache_slots, "-slot cache");
  }
  const int64_t row = (a.heads + 2 * a.kv_heads) * a.dim;
  const int64_t kv_row = a.kv_heads * a.dim;
  TANDEM_DISPATCH(qkv.scalar_type(), "rope_write_kv", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cos_table = cos.data_ptr<scalar_t>();
    const scalar_t* sin_table = sin.data_ptr<scalar_t>();
    scalar_t* keys = k_cache.data_ptr<scalar_t>();
    scalar_t* values = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, a.tokens, 32, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(a.dim);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* x = base + t * row;
        const scalar_t* c = cos_table + pos[t] * a.dim;
        const scalar_t* s = sin_table + pos[t] * a.dim;
        for (int64_t h = 0; h < a.heads + a.kv_heads; ++h) rotate_row(x + h * a.dim, c, s, a.dim, scratch.data());
        std::memcpy(keys + slot[t] * kv_row, x + a.heads * a.dim, kv_row * sizeof(scalar_t));
        std::memcpy(values + slot[t] * kv_row, x + (a.heads + a.kv_heads) * a.dim, kv_row * sizeof(scalar_t));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, int num_heads) -> ()",
        &rope_write_kv);
}

}  // namespace tandem
