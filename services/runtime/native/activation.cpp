// SiLU(gate) * up over the fused gate/up projection's output, in one call (model.py's `_mlp` runs
// silu then mul). Rounds as the torch path does: SiLU in float32, rounded to the element type, then
// the product; exp is `fast_exp`/`exp16` (within 2 ulp of torch's), so float32 results agree to a few ulp.
#include "simd.h"

namespace tandem {
namespace {

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#ifdef TANDEM_SIMD
  for (; i + kWidth <= n; i += kWidth) {
    const __m512 g = load16(gate + i);
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    store16(out + i, _mm512_mul_ps(round16<T>(_mm512_div_ps(g, denominator)), load16(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float silu = round_to<T>(g / (1.f + fast_exp(-g)));
    out[i] = static_cast<T>(silu * static_cast<float>(up[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dim of gate_up (",
              gate_up.dim() ? gate_up.size(-1) : 0, ") must be even: gate and up side by side");
  const int64_t width = gate_up.size(-1) / 2;
  auto shape = gate_up.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const int64_t rows = width ? out.numel() / width : 0;
  TANDEM_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(in + 2 * r * width, in + (2 * r + 1) * width, o + r * width, width);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}

}  // namespace tandem
