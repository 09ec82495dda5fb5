// One decode step of a pre-norm decoder (Llama's blocks, GPT-2's and the families between), as one
// call: the embedding, every block and the head in one parallel region of the machine's threads, which
// meet at a barrier between the operations where each needs all of the one before
// (selfattn/generation/kernel_step.py says which models, and why). The products are stream.h's
// products_of, the attention its attend_tasks and merge_runs.
//
//   step(tokens (B, T), past, wte (V, C), wpe, norms, norm_biases, matrices, biases, scales, caches, cos, sin,
//        n_head, eps, scale, norm, act, gated)
//     -> logits (B * T, V) in wte's dtype A: each row's T tokens at positions past .. past + T - 1 (one in a
//        decode step, a few in a speculative verification), causal among themselves
//
// wpe: learned positions (positions, C) added to the embedding, or None; norms: each layer's two norm
// weights (C,), then the final one, with their biases (LayerNorm's, or None); norm: "rmsnorm" or
// "layernorm", of one epsilon eps. matrices: each layer's qkv ((H + 2 Hkv) D, C), proj (C, H D), up
// (I, C; with `gated`, gate and up as one (2 I, C), gate's rows first) and down (C, I), then the head
// (V, C), all of one dtype W (A, or int8 with a float32 scale (out,) each in scales), each with its bias
// in A or None; act: the MLP's activation, "silu", "gelu" or "gelu_tanh" (down(act(gate) * up) when
// gated, down(act(up)) when not). caches: each layer's k and v (B, Hkv, max_len, D) in A, the tokens
// written at slots past ..; cos and sin (positions, R / 2) float32, the rotary angles of the first R
// channels of each head (their attention factor in them; R = 0 without RoPE).
//
// Every value is rounded to A where the model's own step rounds it (a tensor of A holds it): the
// residual stream, each RMSNorm before and after its weight (a LayerNorm once, at its end), each
// product and the bias added to it, the rotated q and k, the attention's output, the activation and
// its product with up. So a float32 step sums as the model's does up to the order of a few sums (the
// norms' moments), and a half-precision one rounds as its eager step does, not as a fused graph does.

#include "stream.h"

namespace {

template <typename A>
inline float as_stored(float x) {  // x rounded to A, as a tensor of A holds it
  return static_cast<float>(static_cast<A>(x));
}

// weight * x / sqrt(mean(x^2) + eps) of one row of C, each factor rounded to A as RMSNorm rounds it
template <typename A, typename X>
void rms_norm(const A* x, const A* w, int64_t C, float eps, X* out) {
  float squares = 0.0f;
  for (int64_t c = 0; c < C; ++c) squares += static_cast<float>(x[c]) * static_cast<float>(x[c]);
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) out[c] = static_cast<X>(as_stored<A>(static_cast<float>(w[c]) * as_stored<A>(static_cast<float>(x[c]) * r)));
}

// (x - mean) / sqrt(variance + eps) * weight + bias of one row of C, in float32, rounded once to A as
// LayerNorm rounds a half-precision row (bias may be nullptr)
template <typename A, typename X>
void layer_norm(const A* x, const A* w, const A* bias, int64_t C, float eps, X* out) {
  float sum = 0.0f, squares = 0.0f;
  for (int64_t c = 0; c < C; ++c) sum += static_cast<float>(x[c]);
  const float mean = sum / static_cast<float>(C);
  for (int64_t c = 0; c < C; ++c) squares += (static_cast<float>(x[c]) - mean) * (static_cast<float>(x[c]) - mean);
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) {
    const float y = (static_cast<float>(x[c]) - mean) * r * static_cast<float>(w[c]);
    out[c] = static_cast<X>(as_stored<A>(bias ? y + static_cast<float>(bias[c]) : y));
  }
}

enum class Act { silu, gelu, gelu_tanh };

// act of L lanes in float32: SiLU x sigmoid(x) and GELU's tanh form 0.5 x (1 + tanh(u)) from exp_lanes
// of -|x| and -2|u| (a few ulps from std::exp's and std::tanh's, which lane by lane took a large share
// of a GPT-2 step of 8 rows: docs/benchmarks.md, "Measurements the code cites"); exact GELU
// 0.5 x (1 + erf(x / sqrt 2)) lane by lane
inline vec activation(Act act, vec x) {
  switch (act) {
    case Act::silu: {
      const vec t = exp_lanes(x < 0.0f ? x : -x);  // e^-|x|
      return x * ((x < 0.0f ? t : splat(1.0f)) / (1.0f + t));
    }
    case Act::gelu_tanh: {
      const vec u = 0.79788456080286536f * (x + 0.044715f * x * x * x), t = exp_lanes(u < 0.0f ? 2.0f * u : -2.0f * u);
      const vec tanh_abs = (1.0f - t) / (1.0f + t);  // tanh |u|
      return 0.5f * x * (1.0f + (u < 0.0f ? -tanh_abs : tanh_abs));
    }
    case Act::gelu:
      for (int i = 0; i < L; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
      return x;
  }
  return x;
}

// out[0 .. n) = act(gate[c]) * gate[up + c] (gated) or act(gate[c]), each rounded to A
template <typename A, typename X>
void activate(Act act, bool gated, const A* gate, int64_t up, int64_t n, X* out) {
  float lanes[L];
  for (int64_t j = 0; j < n; j += L) {
    const int64_t m = std::min<int64_t>(L, n - j);
    for (int64_t i = 0; i < L; ++i) lanes[i] = i < m ? static_cast<float>(gate[j + i]) : 0.0f;
    store(lanes, activation(act, load(lanes)));
    for (int64_t i = 0; i < m; ++i) {
      const float a = as_stored<A>(lanes[i]);
      out[j + i] = static_cast<X>(gated ? as_stored<A>(a * static_cast<float>(gate[up + j + i])) : a);
    }
  }
}

// the first 2 * half channels of a head rotated: (x1 cos - x2 sin, x2 cos + x1 sin), in float32, rounded to A
template <typename A>
void rotate(const A* x, const float* cos, const float* sin, int64_t half, int64_t D, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    out[i] = as_stored<A>(x1 * cos[i] + x2 * -sin[i]);
    out[i + half] = as_stored<A>(x2 * cos[i] + x1 * sin[i]);
  }
  for (int64_t i = 2 * half; i < D; ++i) out[i] = static_cast<float>(x[i]);
}

struct Dims {
  int64_t B, T, C, H, Hkv, D, half, I, V, layers, max_len, past;
  float eps, scale;
  bool layer_norm, gated;  // LayerNorm (else RMSNorm); gate and up in one matrix (else up alone)
  Act act;
};

template <typename A, typename W>
struct Weights {
  const A *wte, *wpe;                  // wpe nullptr: no learned positions
  std::vector<const A*> norms;         // 2 per layer, then the final one
  std::vector<const A*> norm_biases;   // one per norm, nullptr where it has none
  std::vector<const W*> matrices;      // 4 per layer (qkv, proj, up or gate_up, down), then the head
  std::vector<const A*> biases;        // one per matrix, nullptr where it has none
  std::vector<const float*> scales;    // one per matrix, nullptr but for int8
  std::vector<A*> caches;              // k, v per layer
  const float *cos, *sin;              // the angles of every position, half each
};

// X: the products' rows, float32 (holding values of A) or bfloat16 where the CPU pairs them with a bfloat16 matrix
template <typename A, typename W, typename X>
void decode(const Weights<A, W>& m, const Dims& d, const int64_t* tokens, A* logits) {
  const int64_t T = d.T, N = d.B * T, C = d.C, H = d.H, Hkv = d.Hkv, D = d.D, I = d.I, g = H / Hkv;  // N rows: every token
  const int64_t QKV = (H + 2 * Hkv) * D, S = d.past + T, runs = (S + KEYS - 1) / KEYS, tasks = d.B * Hkv * runs;
  const int64_t UP = d.gated ? 2 * I : I;  // the up matrix's rows: gate's and up's, or up's
  std::vector<A> x(N * C), qkv(N * QKV), y(N * C), up(N * UP), heads(N * H * D);  // heads (B, H, T, D)
  std::vector<X> h(N * C), att(N * H * D), act(N * I);
  std::vector<float> q(N * H * D), parts(tasks * g * T * (D + 2)), rotated(D);  // q (B, H, T, D)
  const int64_t cache_strides[4] = {Hkv * d.max_len * D, d.max_len * D, D, 1};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const auto mine = [&](int64_t total) {  // this thread's part [begin, end) of total
      return std::pair<int64_t, int64_t>{total * thread / threads, total * (thread + 1) / threads};
    };
    const auto product = [&](int64_t i, const X* in, int64_t width, A* out, int64_t out_width) {  // matrix i
      const auto [begin, end] = mine(out_width);  // this thread's matrix rows, for every row of in
      products_of(m.matrices[i], in, m.scales[i], out, N, out_width, width, begin, end);
      if (const A* bias = m.biases[i]) {
        for (int64_t n = 0; n < N; ++n) {
          A* row = out + n * out_width;
          for (int64_t o = begin; o < end; ++o) row[o] = static_cast<A>(static_cast<float>(row[o]) + static_cast<float>(bias[o]));
        }
      }
    };
    const auto norm = [&](int64_t i, int64_t row) {  // h[row] = norm i of x[row]
      const A* in = x.data() + row * C;
      if (d.layer_norm) {
        layer_norm(in, m.norms[i], m.norm_biases[i], C, d.eps, h.data() + row * C);
      } else {
        rms_norm(in, m.norms[i], C, d.eps, h.data() + row * C);
      }
    };
    const auto add_and_norm = [&](int64_t i) {  // x += y, h = norm i of x: one thread, then a barrier
#pragma omp single
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t c = r * C; c < (r + 1) * C; ++c) x[c] = static_cast<A>(static_cast<float>(x[c]) + static_cast<float>(y[c]));
        norm(i, r);
      }
    };
#pragma omp single
    for (int64_t r = 0; r < N; ++r) {  // the token's embedding, plus its position's where the model learned them
      const A *token = m.wte + tokens[r] * C, *position = m.wpe ? m.wpe + (d.past + r % T) * C : nullptr;
      for (int64_t c = 0; c < C; ++c) {
        x[r * C + c] = position ? static_cast<A>(static_cast<float>(token[c]) + static_cast<float>(position[c])) : token[c];
      }
      norm(0, r);
    }
    for (int64_t l = 0; l < d.layers; ++l) {
      A *kc = m.caches[2 * l], *vc = m.caches[2 * l + 1];
      product(4 * l, h.data(), C, qkv.data(), QKV);
#pragma omp barrier
#pragma omp single
      for (int64_t i = 0; i < N; ++i) {  // q and k rotated, k and v into the cache
        const int64_t b = i / T, p = d.past + i % T;  // p: the token's position
        const float *cos = m.cos + p * d.half, *sin = m.sin + p * d.half;
        const A* row = qkv.data() + i * QKV;
        for (int64_t hq = 0; hq < H; ++hq) rotate(row + hq * D, cos, sin, d.half, D, q.data() + ((b * H + hq) * T + i % T) * D);
        for (int64_t kh = 0; kh < Hkv; ++kh) {
          const int64_t slot = b * cache_strides[0] + kh * cache_strides[1] + p * D;
          rotate(row + (H + kh) * D, cos, sin, d.half, D, rotated.data());
          for (int64_t c = 0; c < D; ++c) kc[slot + c] = static_cast<A>(rotated[c]);
          std::copy(row + (H + Hkv + kh) * D, row + (H + Hkv + kh + 1) * D, vc + slot);
        }
      }
      {
        const auto [begin, end] = mine(tasks);
        attend_tasks(q.data(), kc, cache_strides, vc, cache_strides, Hkv, S, D, g * T, T, d.scale, parts.data(), begin, end);
      }
#pragma omp barrier
      {
        const auto [begin, end] = mine(N * H);  // query rows of (B, H, T), into att as (B, T, H)
        merge_runs(parts.data(), runs, g * T, D, heads.data(), begin, end);
        for (int64_t r = begin; r < end; ++r) {
          const int64_t b = r / (H * T), hq = r / T % H, t = r % T;
          for (int64_t c = 0; c < D; ++c) att[((b * T + t) * H + hq) * D + c] = static_cast<X>(static_cast<float>(heads[r * D + c]));
        }
      }
#pragma omp barrier
      product(4 * l + 1, att.data(), H * D, y.data(), C);
#pragma omp barrier
      add_and_norm(2 * l + 1);
      product(4 * l + 2, h.data(), C, up.data(), UP);
#pragma omp barrier
      {
        const auto [begin, end] = mine(N * I);
        for (int64_t i = begin; i < end;) {  // this thread's entries, row by row
          const int64_t r = i / I, c = i % I, n = std::min(end - i, I - c);
          activate<A>(d.act, d.gated, up.data() + r * UP + c, I, n, act.data() + i);
          i += n;
        }
      }
#pragma omp barrier
      product(4 * l + 3, act.data(), I, y.data(), C);
#pragma omp barrier
      add_and_norm(2 * l + 2);  // the next layer's first norm, or the final one
    }
    product(4 * d.layers, h.data(), C, logits, d.V);
  }
}

// step's arguments, as the op gives them
struct Args {
  const at::Tensor &tokens, &wte;
  const std::optional<at::Tensor>& wpe;
  at::TensorList norms;
  const c10::List<std::optional<at::Tensor>>& norm_biases;
  at::TensorList matrices;
  const c10::List<std::optional<at::Tensor>>&biases, &scales;
  at::TensorList caches;
  const at::Tensor &cos, &sin;
  int64_t past, n_head;
  double eps, scale;
  bool layer_norm, gated;
  Act act;
};

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

template <typename A, typename W>
at::Tensor decode_as(const Args& a) {
  const int64_t layers = static_cast<int64_t>(a.caches.size()) / 2;
  Weights<A, W> m{a.wte.data_ptr<A>(), data_or_null<A>(a.wpe), {}, {}, {}, {}, {}, {}, a.cos.data_ptr<float>(), a.sin.data_ptr<float>()};
  for (int64_t i = 0; i < static_cast<int64_t>(a.norms.size()); ++i) {
    m.norms.push_back(a.norms[i].data_ptr<A>());
    m.norm_biases.push_back(data_or_null<A>(a.norm_biases.get(i)));
  }
  for (int64_t i = 0; i < static_cast<int64_t>(a.matrices.size()); ++i) {
    m.matrices.push_back(a.matrices[i].data_ptr<W>());
    m.biases.push_back(data_or_null<A>(a.biases.get(i)));
    m.scales.push_back(data_or_null<float>(a.scales.get(i)));
  }
  for (const at::Tensor& c : a.caches) m.caches.push_back(c.data_ptr<A>());
  const at::Tensor& k = a.caches[0];
  const Dims d{a.tokens.size(0), a.tokens.size(1), a.wte.size(1), a.n_head, k.size(1), k.size(3), a.cos.size(1),
               a.matrices[3].size(1), a.matrices.back().size(0), layers, k.size(2), a.past, static_cast<float>(a.eps),
               static_cast<float>(a.scale), a.layer_norm, a.gated, a.act};
  at::Tensor logits = at::empty({d.B * d.T, d.V}, a.wte.options());
  const at::Tensor ids = a.tokens.contiguous();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<A, c10::BFloat16> && std::is_same_v<W, c10::BFloat16>) {
    decode<A, W, c10::BFloat16>(m, d, ids.data_ptr<int64_t>(), logits.data_ptr<A>());
    return logits;
  }
#endif
  decode<A, W, float>(m, d, ids.data_ptr<int64_t>(), logits.data_ptr<A>());
  return logits;
}

template <typename A>
at::Tensor decode_with(const Args& a) {
  return a.matrices[0].scalar_type() == at::kChar ? decode_as<A, int8_t>(a) : decode_as<A, A>(a);
}

Act activation_named(const std::string& name) {
  if (name == "silu") return Act::silu;
  if (name == "gelu") return Act::gelu;
  TORCH_CHECK(name == "gelu_tanh", "decode_kernel.step: an activation silu, gelu or gelu_tanh, got ", name);
  return Act::gelu_tanh;
}

at::Tensor step(const at::Tensor& tokens, int64_t past, const at::Tensor& wte, const std::optional<at::Tensor>& wpe,
                at::TensorList norms, const c10::List<std::optional<at::Tensor>>& norm_biases, at::TensorList matrices,
                const c10::List<std::optional<at::Tensor>>& biases, const c10::List<std::optional<at::Tensor>>& scales,
                at::TensorList caches, const at::Tensor& cos, const at::Tensor& sin, int64_t n_head, double eps, double scale,
                const std::string& norm, const std::string& act, bool gated) {
  // the caller (decode_kernel.py) has checked the model; these hold it to what this file reads
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2, n = static_cast<int64_t>(matrices.size());
  TORCH_CHECK(layers > 0 && n == 4 * layers + 1 && static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  static_cast<int64_t>(norm_biases.size()) == 2 * layers + 1 && static_cast<int64_t>(biases.size()) == n &&
                  static_cast<int64_t>(scales.size()) == n,
              "decode_kernel.step: 2 norms, 4 matrices and k, v per layer, a final norm and the head, each with its bias");
  TORCH_CHECK(norm == "rmsnorm" || norm == "layernorm", "decode_kernel.step: a norm rmsnorm or layernorm, got ", norm);
  const int64_t positions = wpe ? std::min(wpe->size(0), cos.size(0)) : cos.size(0);
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat &&
                  past + tokens.size(1) <= positions && past + tokens.size(1) <= caches[0].size(2),
              "decode_kernel.step: tokens (B, T) int64, float32 angles and slots for positions ", past, " + T");
  for (const at::Tensor& w : matrices) {
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == matrices[0].scalar_type(), "decode_kernel.step: matrices of one dtype, in rows");
  }
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.is_contiguous() && c.sizes() == caches[0].sizes() && c.scalar_type() == wte.scalar_type(),
                "decode_kernel.step: contiguous caches alike, in the embedding's dtype");
  }
  for (const auto& list : {norm_biases, biases}) {
    for (const std::optional<at::Tensor>& b : list) {
      TORCH_CHECK(!b || (b->is_contiguous() && b->scalar_type() == wte.scalar_type()), "decode_kernel.step: biases in the embedding's dtype");
    }
  }
  TORCH_CHECK(wte.is_contiguous() && (!wpe || (wpe->is_contiguous() && wpe->scalar_type() == wte.scalar_type())),
              "decode_kernel.step: wte and wpe in rows, of one dtype");
  const Args a{tokens, wte, wpe, norms, norm_biases, matrices, biases, scales, caches, cos, sin,
               past, n_head, eps, scale, norm == "layernorm", gated, activation_named(act)};
  switch (wte.scalar_type()) {
    case at::kFloat: return decode_with<float>(a);
    case at::kBFloat16: return decode_with<c10::BFloat16>(a);
    case at::kHalf: return decode_with<c10::Half>(a);
    default: TORCH_CHECK(false, "decode_kernel.step: a model of ", wte.scalar_type(), " (float32, bfloat16 or float16)");
  }
}

}  // namespace

// the namespace the build names (-DSELFATTN_NAMESPACE), expanded before TORCH_LIBRARY_FRAGMENT pastes it
#define SELFATTN_DEFINE_MORE(ns) TORCH_LIBRARY_FRAGMENT(ns, m)
#define SELFATTN_IMPLEMENT(ns) TORCH_LIBRARY_IMPL(ns, CPU, m)
SELFATTN_DEFINE_MORE(SELFATTN_NAMESPACE) {
  m.def("step(Tensor tokens, int past, Tensor wte, Tensor? wpe, Tensor[] norms, Tensor?[] norm_biases, Tensor[] matrices, "
        "Tensor?[] biases, Tensor?[] scales, Tensor(a!)[] caches, Tensor cos, Tensor sin, int n_head, float eps, float scale, "
        "str norm, str act, bool gated) -> Tensor");
}
SELFATTN_IMPLEMENT(SELFATTN_NAMESPACE) {
  m.impl("step", &step);
}
