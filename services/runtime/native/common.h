// Helpers shared by Tandem's CPU kernels: element types, argument checks, a vectorizable exp.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

// Runs the lambda with `scalar_t` the element type of a float32, bfloat16 or float16 tensor (the
// model's dtypes); any other dtype raises, naming `name`.
#define TANDEM_DISPATCH(dtype, name, ...)                          \
  AT_DISPATCH_SWITCH(dtype, name,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

inline void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU (the native kernels are CPU-only)");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ (", a.scalar_type(), " vs ",
              b.scalar_type(), ")");
}

// Rounds a float to the element type and back: the rounding torch applies after each op in that type.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// exp(x) within 2 ulp of expf for x in [-87, 88] (Cephes' polynomial after a Cody-Waite reduction),
// written so the compiler vectorizes loops that call it (std::exp stays a scalar call).
inline float fast_exp(float x) {
  x = std::fmin(std::fmax(x, -87.33f), 88.72f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

}  // namespace tandem
