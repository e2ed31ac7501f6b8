// RMSNorm, alone and fused with the residual add before it (one call instead of ~9 ATen ops).
// Rounds as services/runtime/model.py's rms_norm does: float32 inside, the normalized row rounded to
// the model's dtype, then multiplied by the weight in that dtype; the residual add rounds first.
#include "common.h"

namespace tandem {
namespace {

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(x[i + j]);
      lanes[j] += v * v;
    }
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) {
    const float normed = round_to<T>(static_cast<float>(x[k]) * scale);
    out[k] = static_cast<T>(static_cast<float>(weight[k]) * normed);
  }
}

template <typename T>
void add_row(T* hidden, const T* delta, int64_t n) {
  for (int64_t k = 0; k < n; ++k) hidden[k] = static_cast<T>(static_cast<float>(hidden[k]) + static_cast<float>(delta[k]));
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  check_same_dtype(x, weight, "rms_norm(x, weight)");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.numel(), "rms_norm: the last dim of x (", x.size(-1),
              ") must equal the weight's size (", weight.numel(), ")");
}

// Rows of `x` normalized into a new tensor; with `delta`, x += delta first (in place, row by row).
at::Tensor norm_rows(const at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                     double eps) {
  check_norm_args(x, weight);
  if (delta) {
    check_cpu_contiguous(*delta, "delta");
    check_same_dtype(x, *delta, "add_rms_norm(hidden, delta)");
    TORCH_CHECK(delta->sizes() == x.sizes(), "add_rms_norm: delta's shape ", delta->sizes(),
                " must equal hidden's ", x.sizes());
  }
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  TANDEM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* ds = delta ? delta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (ds) add_row(xs + r * n, ds + r * n, n);
        norm_row(xs + r * n, w, os + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_rows(x, c10::nullopt, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm_rows(hidden, delta, weight, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
}

}  // namespace tandem
