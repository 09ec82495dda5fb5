// The vector helpers and the loops that matvec.cpp (rows, attend) and decode.cpp (step) share: a few
// rows times a matrix streamed once (products_of), and causal queries over runs of the KV cache
// (attend_tasks, merge_runs). Everything here is a template or inline, in an anonymous namespace: each
// translation unit that includes it has its own copy, built for the instruction set of the library.
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
// it (AVX-512 with or without AVX512-BF16, AVX2 or the compiler's baseline), and with it the sums'
// order (the vectors' width). Intrinsics only where GCC's generic code was slow or loose: widening
// int8, float16 and bfloat16, the fused multiply-add, and AVX512-BF16's pair products for bfloat16
// rows x a bfloat16 matrix.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

// A vector is one 256-bit register where the build has AVX2 (the AVX-512 builds too: their 512-bit
// vectors streamed a float32 matrix slower on the EPYC, and a SmolLM2 step took longer), else one
// 128-bit register. (Vectors wider than the registers cost far more than two: GCC 12 lowers parts of
// their operations through the stack. The timings: docs/benchmarks.md, "Measurements the code cites".)
#if defined(__AVX2__)
constexpr int L = 8;   // lanes of a vector
#else
constexpr int L = 4;
#endif
#if defined(__AVX512F__)
constexpr int R = 4;   // rows per pass over a matrix row: R * S accumulators fit the 32 registers
constexpr int NV = 4;  // vectors of a value row weighed at once (attend): G * NV accumulators, G <= 4
constexpr int QG = 3;  // query rows scored at once (attend): QG * L accumulators
#else
constexpr int R = 2;   // ... the 16
constexpr int NV = 2;
constexpr int QG = 1;
#endif
constexpr int S = 4;   // partial sums per row (independent chains of fused multiply-adds)

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
using vec = std::conditional_t<L == 8, f32x8, f32x4>;
typedef int32_t ivec __attribute__((vector_size(4 * L)));
typedef uint32_t uvec __attribute__((vector_size(4 * L)));
typedef uint16_t u16vec __attribute__((vector_size(2 * L)));

inline vec splat(float x) {  // x in every lane (x - 0 is x, -0 included: one broadcast; lane by lane, GCC inserted each)
  return x - vec{};
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// L consecutive entries widened to float32
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vec load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
#if defined(__AVX2__)  // (GCC widens the generic form below in two halves)
  return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  u16vec h;
  std::memcpy(&h, p, sizeof h);
  return (vec)(__builtin_convertvector(h, uvec) << 16);
#endif
}

inline vec load(const c10::Half* p) {
#if defined(__AVX2__) && defined(__F16C__)
  return (vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vec v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline vec load(const int8_t* p) {  // GCC 12 widens an int8 vector entry by entry: intrinsics
#if defined(__AVX2__)
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__SSE2__)  // each byte repeated to fill a 32-bit lane, then shifted down with its sign
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i bytes = _mm_cvtsi32_si128(four), twice = _mm_unpacklo_epi8(bytes, bytes);
  return (vec)_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(twice, twice), 24));
#else
  vec v;
  for (int i = 0; i < L; ++i) v[i] = p[i];
  return v;
#endif
}

// acc + a * b, rounded once where the machine fuses it. The build turns contraction off
// (-ffp-contract=off): left to the compiler, one instance of a loop fused where another did not, and
// a row's bits depended on the rows beside it.
inline vec fma(vec a, vec b, vec acc) {
#if defined(__AVX2__) && defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

// the sum of a vector's lanes, halves added pairwise (8 -> 4 -> 1): a fixed order
inline float sum_lanes(f32x4 q) { return (q[0] + q[2]) + (q[1] + q[3]); }
inline float sum_lanes(f32x8 h) { return sum_lanes(__builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7)); }

// The sums of Rows rows x (each `in` long, float32) with one matrix row w, into sums[0 .. Rows).
// Every loop over rows or partial sums is unrolled before GCC splits the accumulator array into
// registers (its scalar replacement needs constant indices): left as loops, the array lives in memory,
// zeroed and spilled around every matrix row, which halved the speed of a row of 576 entries.
template <int Rows, typename W>
inline void dot(const W* w, const float* x, int64_t in, float* sums) {
  vec acc[Rows][S] = {};
  int64_t k = 0;
  for (; k + S * L <= in; k += S * L) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const vec wv = load(w + k + s * L);
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) acc[r][s] = fma(wv, load(x + r * in + k + s * L), acc[r][s]);
    }
  }
  // the runs left over (fewer than S) continue the partial sums in turn, each s a constant
  const auto leftover = [&](auto s) {
    const vec wv = load(w + k);
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
// bfloat16 rows x a bfloat16 matrix where the CPU has AVX512-BF16: vdpbf16ps takes a vector of 8
// pairs of each, multiplies them exactly and adds each pair's two products into the float32 sum of
// its lane (denormals flushed), with no widening. S partial sums take runs of P entries in turn, as
// dot's take runs of L: one order however many rows come together.
constexpr int P = 2 * L;  // entries per vector

inline __m256bh pairs(const c10::BFloat16* p) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <int Rows>
inline void dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t in, float* sums) {
  __m256 acc[Rows][S];
#pragma GCC unroll 4
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  const auto run = [&](auto s) {  // the run of P entries at k into partial sum s
    const __m256bh wv = pairs(w + k);
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) acc[r][s] = _mm256_dpbf16_ps(acc[r][s], wv, pairs(x + r * in + k));
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
    sums[r] = sum_lanes((vec)_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
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

// Several rows make the products compute-bound, and the matrix must then be fetched while they compute:
// the core's out-of-order window, which keeps enough of one row's loads from memory in flight, fills
// with multiply-adds. So a group of GROUP_BYTES of matrix rows, held in L1 while every block of rows
// passes over it, asks L2 for the next group's as the first block passes (selfattn/kernels/matvec.py has
// what it gained).
constexpr int64_t GROUP_BYTES = 16 << 10;

// a hint to bring rows [0, n) of d entries, stride apart, toward the core before they are read
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t n, int64_t d) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < d; i += 64 / sizeof(T)) __builtin_prefetch(p + j * stride + i, 0, 2);
  }
}

// y (N, out), written as Y, its columns [begin, end) (matrix rows); x (N, in) float32, or bfloat16 for dot's pairs
template <typename W, typename X, typename Y>
void products_of(const W* w, const X* x, const float* scale, Y* y, int64_t n, int64_t out, int64_t in, int64_t begin,
                 int64_t end) {
  float sums[R];
  const int64_t group = std::max<int64_t>(4, GROUP_BYTES / (in * static_cast<int64_t>(sizeof(W))));  // matrix rows
  for (int64_t g = begin; g < end; g += group) {
    const int64_t g_end = std::min(end, g + group);
    for (int64_t r = 0; r < n; r += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, n - r));
      for (int64_t o = g; o < g_end; ++o) {
        if (n > 1 && r == 0 && o + group < end) prefetch_rows(w + (o + group) * in, in, 1, in);
        block<R>(w + o * in, x + r * in, in, sums, rows);
        const float s = scale ? scale[o] : 1.0f;
        for (int i = 0; i < rows; ++i) y[(r + i) * out + o] = static_cast<Y>(scale ? sums[i] * s : sums[i]);
      }
    }
  }
}

// ---- A few queries per head over the KV cache: a decoded token's attention, a verification's -------
//
//   attend(q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, D), scale) -> (B, H, T, D) in q's dtype
//   out[b, h, t] = softmax_{j <= S - T + t}(scale * q[b, h, t] . k[b, h / g, j]) . v[b, h / g, j]   (g = H / Hkv)
//
// The T queries are the last T positions of the S keys, causal (one query sees every key). The cache
// streams once: each task takes a run of KEYS keys of one kv head for the g * T query rows that read
// it, their scores, exponentials and weighted values in float32 (the run's maximum subtracted), and
// the runs are merged in order after (each run's sums rescaled to the overall maximum, as
// FlashAttention's split over keys does). The runs are fixed, so the bits do not depend on the
// threads. k and v may be any views whose rows are contiguous (a cache's first S slots). Within a
// task each key row is loaded (and widened) once for QG query rows, each value row once for 4: a
// SmolLM2 bfloat16 verification of 8 tokens ran faster than with each query row reading its keys
// (docs/benchmarks.md, "Measurements the code cites").
constexpr int64_t KEYS = 128;  // keys per task

// exp(x) for x <= 0, to about 1 ulp: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor
// polynomial of degree 7, 2^n put in the exponent's bits; below -87 (a weight under 2^-126) it is
// taken at -87, a weight of about 2^-125.5 (the sum it joins is at least 1)
inline vec exp_lanes(vec x) {
  x = x < -87.0f ? vec{} - 87.0f : x;
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x * 1.44269504088896341f + magic) - magic;
  const vec r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  // ln 2 in two parts
  vec p = vec{} + 1.0f / 5040;
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  return p * (vec)bits;
}

// The sums of L vectors, lane i holding acc[i]'s, by a tree: the vectors taken in pairs, each pair's
// halves exchanged and added (blocks of L / 2 lanes), then the L / 2 vectors so made in pairs with
// blocks of L / 4, ..., down to one vector. Taking the vectors in bit-reversed order leaves the sums
// in their own.
constexpr int reversed(int i) {  // i's log2(L) bits reversed
  int r = 0;
  for (int bit = 1; bit < L; bit <<= 1) r = r << 1 | ((i & bit) != 0);
  return r;
}

constexpr int pair_lane(int i, int block, int second) {  // lane i of a pair's halves, in blocks of x's and y's in turn
  const int b = i / block, o = i % block;
  return (b % 2 ? L : 0) + (b - b % 2 + second) * block + o;
}

template <int Block, std::size_t... I>
inline vec add_pair(vec x, vec y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, pair_lane(I, Block, 0)...) + __builtin_shufflevector(x, y, pair_lane(I, Block, 1)...);
}

// (Every index below is a constant as the code is parsed, not only once loops are unrolled: GCC keeps
// the callers' accumulator arrays in registers only then, and stored them to memory at every step.)
template <int Block, std::size_t... I>
inline vec tree(const vec* a, std::index_sequence<I...>) {  // 2 * Block vectors -> 1
  const vec pairs[Block] = {add_pair<Block>(a[2 * I], a[2 * I + 1], std::make_index_sequence<L>{})...};
  if constexpr (Block == 1) {
    return pairs[0];
  } else {
    return tree<Block / 2>(pairs, std::make_index_sequence<Block / 2>{});
  }
}

template <std::size_t... I>
inline vec sum_each(const vec* acc, std::index_sequence<I...>) {
  const vec a[L] = {acc[reversed(I)]...};
  return tree<L / 2>(a, std::make_index_sequence<L / 2>{});
}

inline vec sum_each(const vec* acc) { return sum_each(acc, std::make_index_sequence<L>{}); }

// G query rows q (float32, D apart) . each of L rows of k (the first d entries of each, rows sk apart)
// into s[h * KEYS .. + L) for row h: each key row read (and widened) once for the G rows
template <int G, typename T>
inline void dot_rows(const float* q, const T* k, int64_t sk, int64_t d, float* s) {
  vec acc[G][L] = {};
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    vec qv[G];
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) qv[h] = load(q + h * d + i);
#pragma GCC unroll 16
    for (int j = 0; j < L; ++j) {
      const vec kv = load(k + j * sk + i);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) acc[h][j] = fma(qv[h], kv, acc[h][j]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) {
    store(s + h * KEYS, sum_each(acc[h]));
    for (int j = 0; j < L; ++j) {  // the entries past the last L
      for (int64_t t = i; t < d; ++t) s[h * KEYS + j] += q[h * d + t] * static_cast<float>(k[j * sk + t]);
    }
  }
}

// out[h] (N vectors of L, for G query rows h) = sum_j p[h][j] * v[j] over n rows of v, entries [0, N * L) of each
template <int G, int N, typename T>
inline void weigh_rows(const float* p, int64_t pstride, const T* v, int64_t sv, int64_t n, float* out, int64_t ostride) {
  vec acc[G][N] = {};
  for (int64_t j = 0; j < n; ++j) {
    vec row[N];
#pragma GCC unroll 4
    for (int b = 0; b < N; ++b) row[b] = load(v + j * sv + b * L);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const vec w = splat(p[h * pstride + j]);
#pragma GCC unroll 4
      for (int b = 0; b < N; ++b) acc[h][b] = fma(w, row[b], acc[h][b]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) {
#pragma GCC unroll 4
    for (int b = 0; b < N; ++b) store(out + h * ostride + b * L, acc[h][b]);  // (a copy of the array kept it in memory)
  }
}

template <int G, typename T>
void weigh(const float* p, int64_t pstride, const T* v, int64_t sv, int64_t n, int64_t d, float* out, int64_t ostride) {
  int64_t i = 0;  // blocks of NV vectors, then what is left of them, then the entries past the last L
  for (; i + NV * L <= d; i += NV * L) weigh_rows<G, NV>(p, pstride, v + i, sv, n, out + i, ostride);
  static_assert(NV <= 4, "three vectors left at most");
  switch ((d - i) / L) {
    case 3: weigh_rows<G, 3>(p, pstride, v + i, sv, n, out + i, ostride); break;
    case 2: weigh_rows<G, 2>(p, pstride, v + i, sv, n, out + i, ostride); break;
    case 1: weigh_rows<G, 1>(p, pstride, v + i, sv, n, out + i, ostride); break;
  }
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t t = i + (d - i) / L * L; t < d; ++t) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += p[h * pstride + j] * static_cast<float>(v[j * sv + t]);
      out[h * ostride + t] = sum;
    }
  }
}

// Which keys of the cache each query row sees, and what happens to its scores: attend's rule (every key up to
// the query's position, the scores as they are) unless a layer of decode.cpp sets more. Query row r of a kv
// head's rows (g heads of T queries) is the token at position past + r % T, of the group's head r / T.
struct KeyRule {
  int64_t past, queries;          // the queries' positions: past .. past + queries - 1
  int64_t sinks = 0, ring = 0;    // ring > 0: a rolling cache, slots [0, sinks) for the first positions, then a ring
  int64_t window = 0;             // > 0: a query sees its `window` latest positions (and the sinks)
  const float* slopes = nullptr;  // ALiBi: the group's heads' slopes, score - slope * (query - key position)
  float softcap = 0.0f;           // > 0: the score soft-capped, c tanh(score / c)

  bool plain() const { return ring == 0 && window == 0 && slopes == nullptr && softcap == 0.0f; }
  // the position slot j holds, -1 for an empty one: itself in a plain cache; in a rolling one a sink's own, else the
  // latest position written to its place in the ring
  int64_t position(int64_t j) const {
    if (ring == 0 || j < sinks) return j < past + queries ? j : -1;
    const int64_t back = past + queries - 1 - j;  // how far the latest position is past the slot's first
    return back < 0 ? -1 : j + back / ring * ring;
  }
  bool sees(int64_t query, int64_t key) const {
    return key >= 0 && key <= query && (window == 0 || key > query - window || key < sinks);
  }
};

// A run of keys [j0, j1) of one kv head for its query rows qf (rows, D) float32 (rule: which keys each sees, and
// the scores' changes): each row's maximum score m, the sum l of its exponentials and the weighted values acc
// (D,), into part (rows, D + 2). A row that sees none of the run has m = -inf, l = 0, acc = 0.
template <typename T>
void attend_run(const float* qf, const T* k, const T* v, int64_t sk, int64_t sv, int64_t j0, int64_t j1,
                int64_t rows, const KeyRule& rule, int64_t D, float scale, float* part) {
  const int64_t n = j1 - j0, queries = rule.queries;
  std::vector<float> p(rows * KEYS);  // (rows, KEYS): the scores, then their exponentials, 0 past what a row sees
  prefetch_rows(k + j0 * sk, sk, n, D);
  prefetch_rows(v + j0 * sv, sv, n, D);
  const auto seen_by = [&](int64_t r) {  // the keys of the run scored for row r: those up to its position, or all
    return rule.ring ? n : std::clamp<int64_t>(rule.past + r % queries + 1 - j0, 0, n);
  };
  for (int64_t r = 0; r < rows; r += QG) {  // the scores of QG rows at a time, in the blocks of L keys that one sees
    const int64_t g = std::min<int64_t>(QG, rows - r);
    int64_t blocks = 0;
    for (int64_t i = r; i < r + g; ++i) blocks = std::max(blocks, seen_by(i) / L * L);
    for (int64_t j = 0; j < blocks; j += L) {
      const T* keys = k + (j0 + j) * sk;
      const float* qr = qf + r * D;
      float* pr = p.data() + r * KEYS + j;
      switch (g) {  // (a row seeing fewer keys than another has scores past them, overwritten below)
        case 3: dot_rows<std::min(3, QG)>(qr, keys, sk, D, pr); break;
        case 2: dot_rows<std::min(2, QG)>(qr, keys, sk, D, pr); break;
        default: dot_rows<1>(qr, keys, sk, D, pr); break;
      }
    }
  }
  bool hidden[KEYS];  // the general rule's keys a row does not see
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seen = seen_by(r);
    const float* qr = qf + r * D;
    float* pr = p.data() + r * KEYS;
    float m = -INFINITY;
    int64_t j = seen / L * L;
    for (; j < seen; ++j) dot<1>(k + (j0 + j) * sk, qr, D, pr + j);  // the last keys, fewer than L: the products' dot
    if (rule.plain()) {  // every key scored is seen
      vec top = splat(-INFINITY);  // each lane's maximum score
      for (j = 0; j + L <= seen; j += L) {
        const vec scores = load(pr + j) * scale;
        store(pr + j, scores);
        top = top > scores ? top : scores;
      }
      for (; j < seen; ++j) m = std::max(m, pr[j] *= scale);
      for (int i = 0; i < L; ++i) m = std::max(m, top[i]);
    } else {  // each key's position decides, and the scores change as scores.py says: ALiBi, then the cap
      const int64_t query = rule.past + r % queries;
      const float slope = rule.slopes ? rule.slopes[r / queries] : 0.0f;
      for (j = 0; j < seen; ++j) {
        const int64_t key = rule.position(j0 + j);
        hidden[j] = !rule.sees(query, key);
        float s = pr[j] * scale;
        if (rule.slopes) s -= slope * static_cast<float>(query - key);
        if (rule.softcap > 0.0f) s = std::tanh(s / rule.softcap) * rule.softcap;
        pr[j] = s;
        if (!hidden[j]) m = std::max(m, s);
      }
      if (m == -INFINITY) {  // it sees none of the run
        std::fill(pr, pr + KEYS, 0.0f);
        part[r * (D + 2)] = m, part[r * (D + 2) + 1] = 0.0f;
        continue;
      }
      for (j = 0; j < seen; ++j) pr[j] = hidden[j] ? m : pr[j];  // exp(0), zeroed below
    }
    for (j = seen; j < KEYS; ++j) pr[j] = m;  // past what it sees: computed if in a vector, then zeroed
    for (j = 0; j < seen; j += L) {
      store(pr + j, exp_lanes(load(pr + j) - m));
    }
    std::fill(pr + seen, pr + KEYS, 0.0f);
    if (!rule.plain()) {
      for (j = 0; j < seen; ++j) pr[j] = hidden[j] ? 0.0f : pr[j];
    }
    vec sum{};  // the exponentials summed in L lanes, then across them
    for (j = 0; j < KEYS; j += L) sum += load(pr + j);
    part[r * (D + 2)] = m, part[r * (D + 2) + 1] = sum_lanes(sum);
  }
  for (int64_t r = 0; r < rows; r += 4) {  // the values weighed for 4 rows at a time, each value read once
    const float* pr = p.data() + r * KEYS;
    float* out = part + r * (D + 2) + 2;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: weigh<4>(pr, KEYS, v + j0 * sv, sv, n, D, out, D + 2); break;
      case 3: weigh<3>(pr, KEYS, v + j0 * sv, sv, n, D, out, D + 2); break;
      case 2: weigh<2>(pr, KEYS, v + j0 * sv, sv, n, D, out, D + 2); break;
      case 1: weigh<1>(pr, KEYS, v + j0 * sv, sv, n, D, out, D + 2); break;
    }
  }
}

// The runs of keys of attend: task t is run t % runs of kv head t / runs % Hkv of batch row t / (Hkv * runs); q (B, H, T,
// D) float32; k and v (B, Hkv, S, D) of strides ks and vs (rows contiguous), S the slots scanned; the parts (tasks,
// rows, D + 2) of attend_run.
template <typename T>
void attend_tasks(const float* q, const T* k, const int64_t* ks, const T* v, const int64_t* vs, int64_t Hkv, int64_t S,
                  int64_t D, int64_t rows, const KeyRule& rule, float scale, float* parts, int64_t begin, int64_t end) {
  const int64_t runs = (S + KEYS - 1) / KEYS, g = rows / rule.queries;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / (Hkv * runs), kh = t / runs % Hkv, j0 = t % runs * KEYS;
    KeyRule group = rule;  // the kv head's query heads' slopes
    if (rule.slopes) group.slopes = rule.slopes + kh * g;
    attend_run(q + (b * Hkv + kh) * rows * D, k + b * ks[0] + kh * ks[1], v + b * vs[0] + kh * vs[1], ks[2], vs[2], j0,
               std::min(S, j0 + KEYS), rows, group, D, scale, parts + t * rows * (D + 2));
  }
}

// query rows [begin, end) of attend's output (B * Hkv * rows of them, in q's order): each row's runs merged in order,
// rescaled to the maximum; with learned sinks (one logit per head, Hkv kv heads of rows / queries heads), the row's
// head's sink joins the denominator, carrying no value
template <typename Q>
void merge_runs(const float* parts, int64_t runs, int64_t rows, int64_t D, Q* out, int64_t begin, int64_t end,
                const float* sinks = nullptr, int64_t Hkv = 1, int64_t queries = 1) {
  std::vector<float> acc(D);
  for (int64_t i = begin; i < end; ++i) {
    const float* first = parts + ((i / rows) * runs * rows + i % rows) * (D + 2);
    const float sink = sinks ? sinks[i / rows % Hkv * (rows / queries) + i % rows / queries] : -INFINITY;
    float m = sink, l = 0.0f;
    for (int64_t run = 0; run < runs; ++run) m = std::max(m, first[run * rows * (D + 2)]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t run = 0; run < runs; ++run) {
      const float* part = first + run * rows * (D + 2);
      const float w = part[1] == 0.0f ? 0.0f : std::exp(part[0] - m);  // a run it does not see: nothing
      l += part[1] * w;
      for (int64_t c = 0; c < D; ++c) acc[c] += part[2 + c] * w;
    }
    if (sinks) l += std::exp(sink - m);
    for (int64_t c = 0; c < D; ++c) out[i * D + c] = static_cast<Q>(acc[c] / l);
  }
}

}  // namespace
