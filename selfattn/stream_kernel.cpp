// A few rows times a matrix, the matrix streamed from memory once: decoding's products
// (selfattn/stream_kernel.py builds this file and says why it exists).
//
//   rows(w (out, in), x (N, in), scale (out,) or None) -> (N, out) in x's dtype
//   y[n, o] = sum_k w[o, k] * x[n, k]  (times scale[o] when given)
//
// w is float32, bfloat16, float16 or int8 (then scale is its per-row float32 scale); x is float32,
// bfloat16 or float16. Every product is summed in float32: the matrix entries and the row are widened
// to float32, exactly, and summed in S partial sums per row that take every S-th run of L entries.
// That order is the same however many rows come together, so a row's result has the same bits
// alone or in a batch of rows (a speculative verification sums a token as a decode step does).
//
// Written with GCC/Clang vector extensions: one source for every instruction set; the build picks
// it (AVX-512 with or without AVX512-BF16, AVX2 or the compiler's baseline). Intrinsics only where
// GCC's generic code was slow or loose: widening int8, float16 and (AVX-512) bfloat16, the fused
// multiply-add, and AVX512-BF16's pair products for bfloat16 rows x a bfloat16 matrix.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int L = 16;  // lanes of a vector: one AVX-512 register, two AVX2 ones
constexpr int S = 4;   // partial sums per row (independent chains of fused multiply-adds)
#if defined(__AVX512F__)
constexpr int R = 4;   // rows per pass over a matrix row: R * S accumulators fit the 32 registers
#else
constexpr int R = 2;   // ... the 16 AVX2 ones (a vector takes two)
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

// L consecutive entries widened to float32
inline f32x16 load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
#if defined(__AVX512F__)  // (GCC splits the generic form below into halves and reassembles them)
  return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
#endif
}

inline f32x16 load(const c10::Half* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  f32x16 v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  f32x16 v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline f32x16 load(const int8_t* p) {  // GCC 12 widens an int8 vector entry by entry: intrinsics
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  f32x16 v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  f32x16 v;
  for (int i = 0; i < L; ++i) v[i] = p[i];
  return v;
#endif
}

inline f32x8 low(f32x16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline f32x8 high(f32x16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

// acc + a * b, rounded once where the machine fuses it. The build turns contraction off
// (-ffp-contract=off): left to the compiler, one instance of a loop fused where another did not, and
// a row's bits depended on the rows beside it.
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 acc) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  const f32x8 lo = (f32x8)_mm256_fmadd_ps((__m256)low(a), (__m256)low(b), (__m256)low(acc));
  const f32x8 hi = (f32x8)_mm256_fmadd_ps((__m256)high(a), (__m256)high(b), (__m256)high(acc));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return acc + a * b;
#endif
}

inline float sum_lanes(f32x16 v) {  // halves added pairwise: 16 -> 8 -> 4 -> 1, a fixed order
  const f32x8 h = low(v) + high(v);
  const f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The sums of Rows rows x (each `in` long, float32) with one matrix row w, into sums[0 .. Rows).
// Every loop over rows or partial sums is unrolled before GCC splits the accumulator array into
// registers (its scalar replacement needs constant indices): left as loops, the array lives in memory,
// zeroed and spilled around every matrix row, which halved the speed of a row of 576 entries.
template <int Rows, typename W>
inline void dot(const W* w, const float* x, int64_t in, float* sums) {
  f32x16 acc[Rows][S] = {};
  int64_t k = 0;
  for (; k + S * L <= in; k += S * L) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const f32x16 wv = load(w + k + s * L);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) acc[r][s] = fma(wv, load(x + r * in + k + s * L), acc[r][s]);
    }
  }
  // the runs left over (fewer than S) continue the partial sums in turn, each s a constant
  const auto leftover = [&](auto s) {
    const f32x16 wv = load(w + k);
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) acc[r][s] = fma(wv, load(x + r * in + k), acc[r][s]);
    k += L;
  };
  static_assert(S == 4, "three leftover runs at most");
  if (k + L <= in) leftover(std::integral_constant<int, 0>{});
  if (k + L <= in) leftover(std::integral_constant<int, 1>{});
  if (k + L <= in) leftover(std::integral_constant<int, 2>{});
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) sums[r] = sum_lanes((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
  for (int r = 0; r < Rows; ++r) {  // the last entries, fewer than L
    for (int64_t j = k; j < in; ++j) sums[r] += static_cast<float>(w[j]) * x[r * in + j];
  }
}

#if defined(__AVX512BF16__)
// bfloat16 rows x a bfloat16 matrix where the CPU has AVX512-BF16: vdpbf16ps takes a vector of 16
// pairs of each, multiplies them exactly and adds each pair's two products into the float32 sum of
// its lane (denormals flushed), with no widening. S partial sums take runs of P entries in turn, as
// dot's take runs of L: one order however many rows come together.
constexpr int P = 2 * L;  // entries per vector

inline __m512bh pairs(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

template <int Rows>
inline void dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t in, float* sums) {
  __m512 acc[Rows][S];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  const auto run = [&](auto s) {  // the run of P entries at k into partial sum s
    const __m512bh wv = pairs(w + k);
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], wv, pairs(x + r * in + k));
    k += P;
  };
  while (k + S * P <= in) {
    run(std::integral_constant<int, 0>{});
    run(std::integral_constant<int, 1>{});
    run(std::integral_constant<int, 2>{});
    run(std::integral_constant<int, 3>{});
  }
  static_assert(S == 4, "three leftover runs at most");
  if (k + P <= in) run(std::integral_constant<int, 0>{});
  if (k + P <= in) run(std::integral_constant<int, 1>{});
  if (k + P <= in) run(std::integral_constant<int, 2>{});
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
    sums[r] = sum_lanes((f32x16)_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    for (int64_t j = k; j < in; ++j) sums[r] += static_cast<float>(w[j]) * static_cast<float>(x[r * in + j]);  // fewer than P
  }
}
#endif

template <int Rows, typename W, typename X>
inline void block(const W* w, const X* x, int64_t in, float* sums, int rows) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return block<Rows - 1>(w, x, in, sums, rows);
  }
  dot<Rows>(w, x, in, sums);
}

// y (N, out), written as Y; x (N, in) float32, or bfloat16 for dot's pairs
template <typename W, typename X, typename Y>
void products(const W* w, const X* x, const float* scale, Y* y, int64_t n, int64_t out, int64_t in) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(in, 1));  // matrix rows per task: 64 K entries
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    float sums[R];
    for (int64_t o = begin; o < end; ++o) {
      const float s = scale ? scale[o] : 1.0f;
      for (int64_t r = 0; r < n; r += R) {  // the matrix row stays in L1 while every block of rows passes
        const int rows = static_cast<int>(std::min<int64_t>(R, n - r));
        block<R>(w + o * in, x + r * in, in, sums, rows);
        for (int i = 0; i < rows; ++i) y[(r + i) * out + o] = static_cast<Y>(scale ? sums[i] * s : sums[i]);
      }
    }
  });
}

template <typename W, typename X>
void products_into(const W* w, const X* x, const float* scale, at::Tensor& y, int64_t n, int64_t out, int64_t in) {
  switch (y.scalar_type()) {
    case at::kFloat: return products(w, x, scale, y.data_ptr<float>(), n, out, in);
    case at::kBFloat16: return products(w, x, scale, y.data_ptr<c10::BFloat16>(), n, out, in);
    case at::kHalf: return products(w, x, scale, y.data_ptr<c10::Half>(), n, out, in);
    default: TORCH_CHECK(false, "stream_kernel.rows: rows of ", y.scalar_type(), " (float32, bfloat16 or float16)");
  }
}

at::Tensor rows(const at::Tensor& w_, const at::Tensor& x_, const std::optional<at::Tensor>& scale_) {
  TORCH_CHECK(w_.dim() == 2 && x_.dim() == 2 && w_.size(1) == x_.size(1), "stream_kernel.rows: w (out, in) and x (N, in), got ",
              w_.sizes(), " and ", x_.sizes());
  TORCH_CHECK(w_.device().is_cpu() && x_.device().is_cpu(), "stream_kernel.rows: CPU tensors only");
  TORCH_CHECK((w_.scalar_type() == at::kChar) == scale_.has_value(), "stream_kernel.rows: int8 w takes a scale, others none");
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
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out, "stream_kernel.rows: scale (out,), got ", scale.sizes());
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
    default: TORCH_CHECK(false, "stream_kernel.rows: a matrix of ", w.scalar_type(), " (float32, bfloat16, float16 or int8)");
  }
  return y;
}

}  // namespace

// the namespace the build names (-DSELFATTN_NAMESPACE), expanded before TORCH_LIBRARY pastes it
#define SELFATTN_DEFINE(ns) TORCH_LIBRARY(ns, m)
#define SELFATTN_IMPLEMENT(ns) TORCH_LIBRARY_IMPL(ns, CPU, m)
SELFATTN_DEFINE(SELFATTN_NAMESPACE) { m.def("rows(Tensor w, Tensor x, Tensor? scale) -> Tensor"); }
SELFATTN_IMPLEMENT(SELFATTN_NAMESPACE) { m.impl("rows", &rows); }
