// Decoding's kernels, each streaming its operand from memory once: a few rows times a matrix (rows),
// and a few queries per head over the KV cache (attend); their loops are matvec.h's.
// (selfattn/kernels/matvec.py says why they exist; selfattn/kernels/build.py builds this file with decode.cpp.)
//
//   rows(w (out, in), x (N, in), scale (out,) or None) -> (N, out) in x's dtype
//   y[n, o] = sum_k w[o, k] * x[n, k]  (times scale[o] when given)

#include "matvec.h"

namespace {

template <typename W, typename X, typename Y>
void products(const W* w, const X* x, const float* scale, Y* y, int64_t n, int64_t out, int64_t in) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(in, 1));  // matrix rows per task: 64 K entries
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) { products_of(w, x, scale, y, n, out, in, begin, end); });
}

template <typename W, typename X>
void products_into(const W* w, const X* x, const float* scale, at::Tensor& y, int64_t n, int64_t out, int64_t in) {
  switch (y.scalar_type()) {
    case at::kFloat: return products(w, x, scale, y.data_ptr<float>(), n, out, in);
    case at::kBFloat16: return products(w, x, scale, y.data_ptr<c10::BFloat16>(), n, out, in);
    case at::kHalf: return products(w, x, scale, y.data_ptr<c10::Half>(), n, out, in);
    default: TORCH_CHECK(false, "matvec.rows: rows of ", y.scalar_type(), " (float32, bfloat16 or float16)");
  }
}

at::Tensor rows(const at::Tensor& w_, const at::Tensor& x_, const std::optional<at::Tensor>& scale_) {
  TORCH_CHECK(w_.dim() == 2 && x_.dim() == 2 && w_.size(1) == x_.size(1), "matvec.rows: w (out, in) and x (N, in), got ",
              w_.sizes(), " and ", x_.sizes());
  TORCH_CHECK(w_.device().is_cpu() && x_.device().is_cpu(), "matvec.rows: CPU tensors only");
  TORCH_CHECK((w_.scalar_type() == at::kChar) == scale_.has_value(), "matvec.rows: int8 w takes a scale, others none");
#if defined(__AVX512BF16__)
  const bool bf16_pairs = w_.scalar_type() == at::kBFloat16 && x_.scalar_type() == at::kBFloat16;  // dot's pairs
#else
  const bool bf16_pairs = false;
#endif
  const at::Tensor w = w_.contiguous(), x = x_.contiguous().to(bf16_pairs ? at::kBFloat16 : at::kFloat);  // x: a few rows, widened once (or paired as they are)
  const int64_t n = x.size(0), out = w.size(0), in = w.size(1);
  at::Tensor scale;
  if (scale_) {
    scale = scale_->contiguous().to(at::kFloat);
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out, "matvec.rows: scale (out,), got ", scale.sizes());
  }
  at::Tensor y = at::empty({n, out}, x_.options());
#if defined(__AVX512BF16__)
  if (bf16_pairs) {
    products_into(w.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), nullptr, y, n, out, in);
    return y;
  }
#endif
  const float* xp = x.data_ptr<float>();
  const float* sp = scale_ ? scale.data_ptr<float>() : nullptr;
  switch (w.scalar_type()) {
    case at::kFloat: products_into(w.data_ptr<float>(), xp, sp, y, n, out, in); break;
    case at::kBFloat16: products_into(w.data_ptr<c10::BFloat16>(), xp, sp, y, n, out, in); break;
    case at::kHalf: products_into(w.data_ptr<c10::Half>(), xp, sp, y, n, out, in); break;
    case at::kChar: products_into(w.data_ptr<int8_t>(), xp, sp, y, n, out, in); break;
    default: TORCH_CHECK(false, "matvec.rows: a matrix of ", w.scalar_type(), " (float32, bfloat16, float16 or int8)");
  }
  return y;
}


template <typename T, typename Q>
void attend_all(const at::Tensor& qf, const at::Tensor& k, const at::Tensor& v, float scale, Q* out) {
  const int64_t B = k.size(0), Hkv = k.size(1), S = k.size(2), D = k.size(3), H = qf.size(1), Tq = qf.size(2);
  const int64_t rows = H / Hkv * Tq;  // the query rows of a kv head: its g heads' T queries, contiguous in q
  const int64_t runs = (S + KEYS - 1) / KEYS, tasks = B * Hkv * runs;
  at::Tensor parts = at::empty({tasks, rows, D + 2}, qf.options());  // (B, Hkv, runs) x (rows, m l acc)
  float* pp = parts.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / (KEYS * rows * D));  // a task's products: 32 K or more
  const KeyRule causal{S - Tq, Tq};  // every key up to the query's position
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    attend_tasks(qf.data_ptr<float>(), k.data_ptr<T>(), k.strides().data(), v.data_ptr<T>(), v.strides().data(), Hkv, S, D,
                 rows, causal, scale, pp, begin, end);
  });
  merge_runs(pp, runs, rows, D, out, 0, B * Hkv * rows);
}

template <typename T>
void attend_into(const at::Tensor& qf, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat: return attend_all<T>(qf, k, v, scale, out.data_ptr<float>());
    case at::kBFloat16: return attend_all<T>(qf, k, v, scale, out.data_ptr<c10::BFloat16>());
    case at::kHalf: return attend_all<T>(qf, k, v, scale, out.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, "matvec.attend: a query of ", out.scalar_type(), " (float32, bfloat16 or float16)");
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_, const at::Tensor& v_, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_.dim() == 4 && v_.sizes() == k_.sizes() && q.size(0) == k_.size(0) &&
                  q.size(3) == k_.size(3) && k_.size(1) > 0 && q.size(1) % k_.size(1) == 0 && q.size(2) > 0 &&
                  q.size(2) <= k_.size(2),
              "matvec.attend: q (B, H, T, D), k and v (B, Hkv, S, D) with 0 < T <= S and H a multiple of Hkv, got ",
              q.sizes(), ", ", k_.sizes(), " and ", v_.sizes());
  TORCH_CHECK(q.device().is_cpu() && k_.device().is_cpu() && v_.device().is_cpu(), "matvec.attend: CPU tensors only");
  TORCH_CHECK(k_.scalar_type() == v_.scalar_type(), "matvec.attend: k and v of one dtype, got ", k_.scalar_type(),
              " and ", v_.scalar_type());
  const at::Tensor k = k_.stride(3) == 1 ? k_ : k_.contiguous(), v = v_.stride(3) == 1 ? v_ : v_.contiguous();
  const at::Tensor qf = q.to(at::kFloat).contiguous();  // (B, H, T, D): the queries widened once
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  switch (k.scalar_type()) {
    case at::kFloat: attend_into<float>(qf, k, v, static_cast<float>(scale), out); break;
    case at::kBFloat16: attend_into<c10::BFloat16>(qf, k, v, static_cast<float>(scale), out); break;
    case at::kHalf: attend_into<c10::Half>(qf, k, v, static_cast<float>(scale), out); break;
    default: TORCH_CHECK(false, "matvec.attend: a cache of ", k.scalar_type(), " (float32, bfloat16 or float16)");
  }
  return out;
}

}  // namespace

// the namespace the build names (-DSELFATTN_NAMESPACE), expanded before TORCH_LIBRARY pastes it
#define SELFATTN_DEFINE(ns) TORCH_LIBRARY(ns, m)
#define SELFATTN_IMPLEMENT(ns) TORCH_LIBRARY_IMPL(ns, CPU, m)
SELFATTN_DEFINE(SELFATTN_NAMESPACE) {
  m.def("rows(Tensor w, Tensor x, Tensor? scale) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}
SELFATTN_IMPLEMENT(SELFATTN_NAMESPACE) {
  m.impl("rows", &rows);
  m.impl("attend", &attend);
}
