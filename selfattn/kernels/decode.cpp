// One decode step of a decoder (Llama's blocks, GPT-2's, Gemma's and the families between), as one call: the
// embedding, every block and the head in one parallel region of the machine's threads, which meet at a barrier
// between the operations where each needs all of the one before (selfattn/generation/kernel_step.py says which
// models, and why). The products are matvec.h's products_of, the attention its attend_tasks and merge_runs.
//
//   step(tokens (B, T), past, wte (V, C), wpe, norms, norm_biases, qk_norms, matrices, biases, scales, caches, layers,
//        cos, sin, alibi, sinks, routers, router_biases, n_head, scale, softcap, logit_softcap, embedding_scale, norm,
//        eps, norm_offset, norm_weight_in_float32, qk_per_head, act, gated, top_k, clamp, alpha)
//     -> logits (B * T, V) in wte's dtype A: each row's T tokens at positions past .. past + T - 1 (one in a
//        decode step, a few in a speculative verification), causal among themselves
//
// A block is x + post(attn(pre(x))), x + post(mlp(pre(x))), each norm there or not. wte's rows are scaled by
// embedding_scale (0: not); wpe: learned positions (positions, C) added to the embedding, or None. norms: the
// embedding's norm, each layer's four (before and after attention, before and after the MLP), the final one, each
// None where the model has none, with their biases (LayerNorm's, or None); norm: "rmsnorm" or "layernorm", of one
// epsilon eps, an RMSNorm scaling by norm_offset + weight, rounded after the weight or before it; qk_norms: each
// layer's q and k norms (the same rule), over each head's D channels (qk_per_head) or over the whole projection.
// matrices: each layer's qkv ((H + 2 Hkv) D, C), proj (C, H D), up (I, C; with `gated`, gate and up as one (2 I, C),
// gate's rows first) and down (C, I), then the head (V, C), all of one dtype W (A, or int8 with a float32 scale
// (out,) each in scales), each with its bias in A or None; act: the MLP's activation, "silu", "gelu" or
// "gelu_tanh" (down(act(gate) * up) when gated, down(act(up)) when not); with top_k > 0 a mixture of experts
// instead (gpt-oss's): each layer's router (E, C) and its bias in routers, router_biases, its experts' gate_up
// (E, 2 I, C; gate and up rows alternating) and down (E, C, I) as the layer's last two matrices, their biases
// (E, out), each token's top_k experts' clamp(clamp) SwiGLU of slope alpha weighed by their softmax. caches: each layer's k and v (B, Hkv,
// slots, D) in A; layers: 4 numbers a layer, its window (0: none), sink tokens, ring (0: a plain cache, position p
// in slot p; else a rolling one, p in slot sinks + (p - sinks) % ring past the sinks) and its table of cos and sin
// (positions, R / 2) float32, the rotary angles of the first R channels of each head (their attention factor in
// them; R = 0 without RoPE). The scores: times scale, minus ALiBi's slope (H,) times the distance (alibi, or None),
// soft-capped at softcap (0: not), a learned sink logit per head (sinks, per layer, or None) in the softmax's
// denominator; the logits soft-capped at logit_softcap (0: not).
//
// Every value is rounded to A where the model's own step rounds it (a tensor of A holds it): the residual stream,
// the scaled embedding, each norm as norms.py rounds it, each product and the bias added to it, the rotated q and k,
// the attention's output, the activation and its product with up, the capped logits. So a float32 step sums as the
// model's does up to the order of a few sums (the norms' moments, the attention's), and a half-precision one
// rounds as its eager step does, not as a fused graph does.

#include <numeric>

#include "matvec.h"

namespace {

template <typename A>
inline float as_stored(float x) {  // x rounded to A, as a tensor of A holds it
  return static_cast<float>(static_cast<A>(x));
}

// How every norm of the model normalises (one kind, epsilon and rounding for all of them, norms.py's Norm)
struct NormRule {
  bool layer_norm;         // LayerNorm, else RMSNorm
  float eps, offset;       // RMSNorm: scaled by offset + weight
  bool weight_in_float32;  // RMSNorm: the weight multiplies before the one rounding to A, else after
};

// norm of one row of C into out, rounded to A as norms.py's RMSNorm or nn.LayerNorm rounds it: an RMSNorm's
// x / sqrt(mean(x^2) + eps) in float32, times offset + weight in float32 then rounded (weight_in_float32), or
// rounded, times the weight (offset added in A) and rounded again; a LayerNorm's (x - mean) / sqrt(variance + eps)
// * weight + bias in float32, rounded once (bias may be nullptr)
template <typename A, typename In, typename X>
void normalize(const NormRule& n, const In* x, const A* w, const A* bias, int64_t C, X* out) {
  float sum = 0.0f, squares = 0.0f;
  if (n.layer_norm) {
    for (int64_t c = 0; c < C; ++c) sum += static_cast<float>(x[c]);
  }
  const float mean = n.layer_norm ? sum / static_cast<float>(C) : 0.0f;
  for (int64_t c = 0; c < C; ++c) squares += (static_cast<float>(x[c]) - mean) * (static_cast<float>(x[c]) - mean);
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(C) + n.eps);
  for (int64_t c = 0; c < C; ++c) {
    const float normed = (static_cast<float>(x[c]) - mean) * r, weight = static_cast<float>(w[c]);
    float y;
    if (n.layer_norm) {
      y = bias ? normed * weight + static_cast<float>(bias[c]) : normed * weight;
    } else if (n.weight_in_float32) {
      y = normed * (weight + n.offset);
    } else {
      y = (n.offset != 0.0f ? as_stored<A>(weight + n.offset) : weight) * as_stored<A>(normed);
    }
    out[c] = static_cast<X>(as_stored<A>(y));
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
template <typename A, typename In>
void rotate(const In* x, const float* cos, const float* sin, int64_t half, int64_t D, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    out[i] = as_stored<A>(x1 * cos[i] + x2 * -sin[i]);
    out[i + half] = as_stored<A>(x2 * cos[i] + x1 * sin[i]);
  }
  for (int64_t i = 2 * half; i < D; ++i) out[i] = static_cast<float>(x[i]);
}

// What differs from layer to layer: its window and cache, and the RoPE it rotates by
struct Layer {
  int64_t window;  // > 0: each query sees its `window` latest positions (and the sinks)
  int64_t sinks;   // the first positions every query sees, kept in slots of their own
  int64_t ring;    // > 0: a rolling cache, position p >= sinks in slot sinks + (p - sinks) % ring; 0: slot p
  int64_t rope;    // its table of angles
  int64_t slots;   // the cache's slots
};

struct Dims {
  int64_t B, T, C, H, Hkv, D, half, I, V, layers, past;
  float scale, softcap, logit_softcap, embedding_scale;  // the caps and the embedding's scale 0 where there is none
  int64_t experts, top_k;  // top_k > 0: the MLP is a mixture of `experts`, each token's top_k of them
  float clamp, alpha;  // its experts' clamp and sigmoid slope
  NormRule norm;
  bool qk_per_head, gated;  // q/k norms over each head (else over the projection); gate and up in one matrix
  Act act;
  std::vector<Layer> layer;

  int64_t slot(const Layer& l, int64_t p) const { return l.ring == 0 || p < l.sinks ? p : l.sinks + (p - l.sinks) % l.ring; }
  int64_t scanned(const Layer& l) const { return std::min(past + T, l.slots); }  // the cache's slots in use
  int64_t runs(const Layer& l) const { return (scanned(l) + KEYS - 1) / KEYS; }
};

template <typename A, typename W>
struct Weights {
  const A *wte, *wpe;                 // wpe nullptr: no learned positions
  std::vector<const A*> norms;        // the embedding's, 4 per layer (before and after attention, before and after
                                      // the MLP), the final one; nullptr where there is none
  std::vector<const A*> norm_biases;  // one per norm, nullptr where it has none
  std::vector<const A*> qk_norms;     // q's and k's per layer, nullptr where there are none
  std::vector<const W*> matrices;     // 4 per layer (qkv, proj, up or gate_up, down; a mixture's experts'
                                      // gate_up and down one after the other), then the head
  std::vector<const A*> biases;       // one per matrix (per expert, one after the other), nullptr where none
  std::vector<const A*> routers, router_biases;  // a mixture's router (E, C) per layer and its bias
  std::vector<const float*> scales;   // one per matrix, nullptr but for int8
  std::vector<A*> caches;             // k, v per layer
  std::vector<const float*> cos, sin; // per RoPE rule, the angles of every position, half each
  const float* alibi;                 // ALiBi's slope per head, or nullptr
  std::vector<const float*> sinks;    // per layer, a learned sink logit per head, or nullptr
};

// the index of a norm in Weights::norms
constexpr int64_t EMBEDDING = 0;
inline int64_t norm_of(int64_t layer, int64_t which) { return 1 + 4 * layer + which; }  // which: 0 .. 3 as stored

// X: the products' rows, float32 (holding values of A) or bfloat16 where the CPU pairs them with a bfloat16 matrix
template <typename A, typename W, typename X>
void decode(const Weights<A, W>& m, const Dims& d, const int64_t* tokens, A* logits) {
  const int64_t T = d.T, N = d.B * T, C = d.C, H = d.H, Hkv = d.Hkv, D = d.D, I = d.I, g = H / Hkv;  // N rows: every token
  const int64_t QKV = (H + 2 * Hkv) * D, UP = d.gated ? 2 * I : I;  // the up matrix's rows: gate's and up's, or up's
  int64_t most_runs = 0;
  for (const Layer& l : d.layer) most_runs = std::max(most_runs, d.runs(l));
  std::vector<A> x(N * C), qkv(N * QKV), y(N * C), up(N * UP), heads(N * H * D);  // heads (B, H, T, D)
  std::vector<X> h(N * C), att(N * H * D), act(N * I);
  std::vector<float> q(N * H * D), parts(d.B * Hkv * most_runs * g * T * (D + 2)), qk((H + Hkv) * D), rotated(D);
  std::vector<A> logits_of_router(N * d.experts), expert_out(d.top_k > 0 ? N * C : 0);  // a mixture's
  std::vector<int64_t> chosen(N * d.top_k);  // each token's experts, by id
  std::vector<float> weights(N * d.top_k);   // and their weights
  const float embedding_scale = as_stored<A>(d.embedding_scale);  // the scale as a tensor of A holds it
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
      return std::pair<int64_t, int64_t>{begin, end};
    };
    const auto norm = [&](int64_t i, const A* in, auto* out) {  // out = norm i of in, or in itself where it has none
      if (m.norms[i]) {
        normalize(d.norm, in, m.norms[i], m.norm_biases[i], C, out);
      } else {
        for (int64_t c = 0; c < C; ++c) out[c] = static_cast<std::remove_pointer_t<decltype(out)>>(static_cast<float>(in[c]));
      }
    };
    // y normed by norm `after` (the sublayer's output norm, if any) and added to x, h = norm `next` of x: one thread,
    // then a barrier
    const auto add_and_norm = [&](int64_t after, int64_t next) {
#pragma omp single
      for (int64_t r = 0; r < N; ++r) {
        A *xr = x.data() + r * C, *yr = y.data() + r * C;
        if (m.norms[after]) normalize(d.norm, yr, m.norms[after], m.norm_biases[after], C, yr);
        for (int64_t c = 0; c < C; ++c) xr[c] = static_cast<A>(static_cast<float>(xr[c]) + static_cast<float>(yr[c]));
        norm(next, xr, h.data() + r * C);
      }
    };
    // A mixture of experts (model.py's MoE) on h into y: each token's router logits, its top_k experts (ties to the
    // lower id) and their softmax weights; each expert's clamped SwiGLU, down((up + 1) gate sigmoid(alpha gate)),
    // with its biases, times its weight, added in the order of the experts' ids, as MoE.forward adds them
    const auto mixture = [&](int64_t l) {
      const int64_t E = d.experts, K = d.top_k;
      {
        const auto [begin, end] = mine(E);
        products_of(m.routers[l], h.data(), static_cast<const float*>(nullptr), logits_of_router.data(), N, E, C, begin, end);
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t e = begin; e < end; ++e) {
            A& z = logits_of_router[n * E + e];
            z = static_cast<A>(static_cast<float>(z) + static_cast<float>(m.router_biases[l][e]));
          }
        }
      }
#pragma omp barrier
#pragma omp single
      for (int64_t n = 0; n < N; ++n) {  // the top k, their softmax (in float32, rounded once), by expert id
        std::vector<int64_t> ids(E);
        std::iota(ids.begin(), ids.end(), 0);
        const A* z = logits_of_router.data() + n * E;
        std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return static_cast<float>(z[a]) > static_cast<float>(z[b]); });
        float top = static_cast<float>(z[ids[0]]), sum = 0.0f;
        for (int64_t j = 0; j < K; ++j) sum += std::exp(static_cast<float>(z[ids[j]]) - top);
        std::sort(ids.begin(), ids.begin() + K);
        for (int64_t j = 0; j < K; ++j) {
          chosen[n * K + j] = ids[j];
          weights[n * K + j] = as_stored<A>(std::exp(static_cast<float>(z[ids[j]]) - top) / sum);
        }
      }
      const int64_t UP2 = 2 * I;
      for (int64_t j = 0; j < K; ++j) {
        {
          const auto [begin, end] = mine(UP2);  // this thread's rows of each token's expert
          for (int64_t n = 0; n < N; ++n) {
            const int64_t e = chosen[n * K + j];
            A* out = up.data() + n * UP2;
            products_of(m.matrices[4 * l + 2] + e * UP2 * C, h.data() + n * C, static_cast<const float*>(nullptr), out, 1, UP2, C, begin, end);
            const A* bias = m.biases[4 * l + 2] + e * UP2;
            for (int64_t o = begin; o < end; ++o) out[o] = static_cast<A>(static_cast<float>(out[o]) + static_cast<float>(bias[o]));
          }
        }
#pragma omp barrier
        {
          const auto [begin, end] = mine(N * I);
          for (int64_t i = begin; i < end; ++i) {  // gate and up alternate in the expert's rows
            const A* gu = up.data() + i / I * UP2 + 2 * (i % I);
            const float gate = std::min(static_cast<float>(gu[0]), d.clamp);
            const float u = std::clamp(static_cast<float>(gu[1]), -d.clamp, d.clamp);
            const float s = as_stored<A>(1.0f / (1.0f + std::exp(-as_stored<A>(gate * d.alpha))));
            act[i] = static_cast<X>(as_stored<A>(as_stored<A>(as_stored<A>(u + 1.0f) * gate) * s));
          }
        }
#pragma omp barrier
        {
          const auto [begin, end] = mine(C);
          for (int64_t n = 0; n < N; ++n) {
            const int64_t e = chosen[n * K + j];
            A* out = expert_out.data() + n * C;
            products_of(m.matrices[4 * l + 3] + e * C * I, act.data() + n * I, static_cast<const float*>(nullptr), out, 1, C, I, begin, end);
            const A* bias = m.biases[4 * l + 3] + e * C;
            for (int64_t o = begin; o < end; ++o) {
              const float weighed = as_stored<A>(as_stored<A>(static_cast<float>(out[o]) + static_cast<float>(bias[o])) * weights[n * K + j]);
              A& sum = y[n * C + o];
              sum = static_cast<A>(j == 0 ? weighed : static_cast<float>(sum) + weighed);
            }
          }
        }
#pragma omp barrier
      }
    };
#pragma omp single
    for (int64_t r = 0; r < N; ++r) {  // the token's embedding (scaled), plus its position's where the model learned them
      const A *token = m.wte + tokens[r] * C, *position = m.wpe ? m.wpe + (d.past + r % T) * C : nullptr;
      A* xr = x.data() + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const float e = d.embedding_scale != 0.0f ? as_stored<A>(static_cast<float>(token[c]) * embedding_scale) : static_cast<float>(token[c]);
        xr[c] = static_cast<A>(position ? e + static_cast<float>(position[c]) : e);
      }
      if (m.norms[EMBEDDING]) normalize(d.norm, xr, m.norms[EMBEDDING], m.norm_biases[EMBEDDING], C, xr);
      norm(norm_of(0, 0), xr, h.data() + r * C);
    }
    for (int64_t l = 0; l < d.layers; ++l) {
      const Layer& layer = d.layer[l];
      A *kc = m.caches[2 * l], *vc = m.caches[2 * l + 1];
      const int64_t strides[4] = {Hkv * layer.slots * D, layer.slots * D, D, 1};
      product(4 * l, h.data(), C, qkv.data(), QKV);
#pragma omp barrier
#pragma omp single
      for (int64_t i = 0; i < N; ++i) {  // q and k normed where the model norms them and rotated, k and v into the cache
        const int64_t b = i / T, p = d.past + i % T, slot = d.slot(layer, p);  // p: the token's position
        const float *cos = m.cos[layer.rope] + p * d.half, *sin = m.sin[layer.rope] + p * d.half;
        const A* row = qkv.data() + i * QKV;
        const A *q_norm = m.qk_norms[2 * l], *k_norm = m.qk_norms[2 * l + 1], *no_bias = nullptr;
        if (q_norm && d.qk_per_head) {
          for (int64_t hq = 0; hq < H; ++hq) normalize(d.norm, row + hq * D, q_norm, no_bias, D, qk.data() + hq * D);
          for (int64_t kh = 0; kh < Hkv; ++kh) normalize(d.norm, row + (H + kh) * D, k_norm, no_bias, D, qk.data() + (H + kh) * D);
        } else if (q_norm) {
          normalize(d.norm, row, q_norm, no_bias, H * D, qk.data());
          normalize(d.norm, row + H * D, k_norm, no_bias, Hkv * D, qk.data() + H * D);
        } else {
          for (int64_t c = 0; c < (H + Hkv) * D; ++c) qk[c] = static_cast<float>(row[c]);
        }
        for (int64_t hq = 0; hq < H; ++hq) {
          rotate<A>(qk.data() + hq * D, cos, sin, d.half, D, q.data() + ((b * H + hq) * T + i % T) * D);
        }
        for (int64_t kh = 0; kh < Hkv; ++kh) {
          const int64_t at = b * strides[0] + kh * strides[1] + slot * D;
          rotate<A>(qk.data() + (H + kh) * D, cos, sin, d.half, D, rotated.data());
          for (int64_t c = 0; c < D; ++c) kc[at + c] = static_cast<A>(rotated[c]);
          std::copy(row + (H + Hkv + kh) * D, row + (H + Hkv + kh + 1) * D, vc + at);
        }
      }
      const KeyRule rule{d.past, T, layer.sinks, layer.ring, layer.window, m.alibi, d.softcap};
      const int64_t runs = d.runs(layer);
      {
        const auto [begin, end] = mine(d.B * Hkv * runs);
        attend_tasks(q.data(), kc, strides, vc, strides, Hkv, d.scanned(layer), D, g * T, rule, d.scale, parts.data(), begin, end);
      }
#pragma omp barrier
      {
        const auto [begin, end] = mine(N * H);  // query rows of (B, H, T), into att as (B, T, H)
        merge_runs(parts.data(), runs, g * T, D, heads.data(), begin, end, m.sinks[l], Hkv, T);
        for (int64_t r = begin; r < end; ++r) {
          const int64_t b = r / (H * T), hq = r / T % H, t = r % T;
          for (int64_t c = 0; c < D; ++c) att[((b * T + t) * H + hq) * D + c] = static_cast<X>(static_cast<float>(heads[r * D + c]));
        }
      }
#pragma omp barrier
      product(4 * l + 1, att.data(), H * D, y.data(), C);
#pragma omp barrier
      add_and_norm(norm_of(l, 1), norm_of(l, 2));
      if (d.top_k > 0) {
        mixture(l);
      } else {
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
      }
#pragma omp barrier
      add_and_norm(norm_of(l, 3), l + 1 < d.layers ? norm_of(l + 1, 0) : norm_of(d.layers, 0));  // the next layer's first norm, or the final one
    }
    const auto [begin, end] = product(4 * d.layers, h.data(), C, logits, d.V);
    if (const float cap = d.logit_softcap; cap > 0.0f) {  // tanh(logits / cap) * cap, each step rounded to A
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t o = begin; o < end; ++o) {
          A& z = logits[n * d.V + o];
          z = static_cast<A>(as_stored<A>(std::tanh(as_stored<A>(static_cast<float>(z) / cap))) * cap);
        }
      }
    }
  }
}

// step's arguments, as the op gives them
struct Args {
  const at::Tensor &tokens, &wte;
  const std::optional<at::Tensor>& wpe;
  const c10::List<std::optional<at::Tensor>>&norms, &norm_biases, &qk_norms;
  at::TensorList matrices;
  const c10::List<std::optional<at::Tensor>>&biases, &scales;
  at::TensorList caches, cos, sin;
  const std::optional<at::Tensor>& alibi;
  const c10::List<std::optional<at::Tensor>>&sinks, &routers, &router_biases;
  Dims dims;
};

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

template <typename A, typename W>
at::Tensor decode_as(const Args& a) {
  Weights<A, W> m{a.wte.data_ptr<A>(), data_or_null<A>(a.wpe), {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {},
                  data_or_null<float>(a.alibi), {}};
  for (int64_t i = 0; i < static_cast<int64_t>(a.norms.size()); ++i) {
    m.norms.push_back(data_or_null<A>(a.norms.get(i)));
    m.norm_biases.push_back(data_or_null<A>(a.norm_biases.get(i)));
  }
  for (const std::optional<at::Tensor>& w : a.qk_norms) m.qk_norms.push_back(data_or_null<A>(w));
  for (int64_t i = 0; i < static_cast<int64_t>(a.matrices.size()); ++i) {
    m.matrices.push_back(a.matrices[i].data_ptr<W>());
    m.biases.push_back(data_or_null<A>(a.biases.get(i)));
    m.scales.push_back(data_or_null<float>(a.scales.get(i)));
  }
  for (const at::Tensor& c : a.caches) m.caches.push_back(c.data_ptr<A>());
  for (int64_t i = 0; i < static_cast<int64_t>(a.cos.size()); ++i) {
    m.cos.push_back(a.cos[i].data_ptr<float>());
    m.sin.push_back(a.sin[i].data_ptr<float>());
  }
  for (const std::optional<at::Tensor>& s : a.sinks) m.sinks.push_back(data_or_null<float>(s));
  for (int64_t i = 0; i < static_cast<int64_t>(a.routers.size()); ++i) {
    m.routers.push_back(data_or_null<A>(a.routers.get(i)));
    m.router_biases.push_back(data_or_null<A>(a.router_biases.get(i)));
  }
  const Dims& d = a.dims;
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

void check_dtype(const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(!t || (t->is_contiguous() && t->scalar_type() == dtype && (numel < 0 || t->numel() == numel)),
              "decode_kernel.step: ", what);
}

at::Tensor step(const at::Tensor& tokens, int64_t past, const at::Tensor& wte, const std::optional<at::Tensor>& wpe,
                const c10::List<std::optional<at::Tensor>>& norms, const c10::List<std::optional<at::Tensor>>& norm_biases,
                const c10::List<std::optional<at::Tensor>>& qk_norms, at::TensorList matrices,
                const c10::List<std::optional<at::Tensor>>& biases, const c10::List<std::optional<at::Tensor>>& scales,
                at::TensorList caches, at::IntArrayRef layers, at::TensorList cos, at::TensorList sin,
                const std::optional<at::Tensor>& alibi, const c10::List<std::optional<at::Tensor>>& sinks,
                const c10::List<std::optional<at::Tensor>>& routers, const c10::List<std::optional<at::Tensor>>& router_biases,
                int64_t n_head, double scale, double softcap, double logit_softcap, double embedding_scale,
                const std::string& norm, double eps, double norm_offset, bool norm_weight_in_float32, bool qk_per_head,
                const std::string& act, bool gated, int64_t top_k, double clamp, double alpha) {
  // the caller (kernel_step.py) has checked the model; these hold it to what this file reads
  const int64_t L = static_cast<int64_t>(caches.size()) / 2, n = static_cast<int64_t>(matrices.size());
  TORCH_CHECK(L > 0 && n == 4 * L + 1 && static_cast<int64_t>(norms.size()) == 4 * L + 2 &&
                  static_cast<int64_t>(norm_biases.size()) == 4 * L + 2 && static_cast<int64_t>(qk_norms.size()) == 2 * L &&
                  static_cast<int64_t>(biases.size()) == n && static_cast<int64_t>(scales.size()) == n &&
                  static_cast<int64_t>(layers.size()) == 4 * L && static_cast<int64_t>(sinks.size()) == L,
              "decode_kernel.step: per layer 4 norms, 2 q/k norms, 4 matrices, k and v, 4 numbers and its sinks; the "
              "embedding's and the final norm and the head, each matrix with its bias");
  TORCH_CHECK(norm == "rmsnorm" || norm == "layernorm", "decode_kernel.step: a norm rmsnorm or layernorm, got ", norm);
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decode_kernel.step: cos and sin tables alike");
  const at::Tensor& k = caches[0];
  const int64_t B = tokens.size(0), T = tokens.size(1), C = wte.size(1), Hkv = k.size(1), D = k.size(3);
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && T > 0, "decode_kernel.step: tokens (B, T) int64");
  TORCH_CHECK(!wpe || past + T <= wpe->size(0), "decode_kernel.step: learned positions for ", past, " + T");
  std::vector<Layer> per_layer;
  for (int64_t l = 0; l < L; ++l) {
    const Layer layer{layers[4 * l], layers[4 * l + 1], layers[4 * l + 2], layers[4 * l + 3], caches[2 * l].size(2)};
    TORCH_CHECK(layer.rope >= 0 && layer.rope < static_cast<int64_t>(cos.size()) && layer.window >= 0 && layer.sinks >= 0 &&
                    layer.ring >= 0 && (layer.ring ? layer.sinks + layer.ring == layer.slots : past + T <= layer.slots) &&
                    cos[layer.rope].size(0) >= past + T,
                "decode_kernel.step: layer ", l, ": a RoPE table, slots and angles for positions ", past, " + T");
    per_layer.push_back(layer);
  }
  for (const at::Tensor& w : matrices) {
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == matrices[0].scalar_type(), "decode_kernel.step: matrices of one dtype, in rows");
  }
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.is_contiguous() && c.size(0) == B && c.size(1) == Hkv && c.size(3) == D && c.scalar_type() == wte.scalar_type(),
                "decode_kernel.step: contiguous caches (B, Hkv, slots, D) in the embedding's dtype");
  }
  for (int64_t i = 0; i < static_cast<int64_t>(cos.size()); ++i) {
    TORCH_CHECK(cos[i].is_contiguous() && sin[i].is_contiguous() && cos[i].scalar_type() == at::kFloat &&
                    cos[i].sizes() == sin[i].sizes() && cos[i].size(1) == cos[0].size(1),
                "decode_kernel.step: float32 angles (positions, R / 2), one R");
  }
  for (const auto& list : {norms, norm_biases}) {
    for (const std::optional<at::Tensor>& w : list) check_dtype(w, wte.scalar_type(), C, "norms of C in the embedding's dtype");
  }
  for (const std::optional<at::Tensor>& w : qk_norms) check_dtype(w, wte.scalar_type(), -1, "q/k norms in the embedding's dtype");
  for (const std::optional<at::Tensor>& b : biases) check_dtype(b, wte.scalar_type(), -1, "biases in the embedding's dtype");
  for (const std::optional<at::Tensor>& s : sinks) check_dtype(s, at::kFloat, n_head, "float32 sinks, one per head");
  check_dtype(alibi, at::kFloat, n_head, "float32 ALiBi slopes, one per head");
  const int64_t experts = top_k > 0 && routers.size() > 0 && routers.get(0) ? routers.get(0)->size(0) : 0;
  TORCH_CHECK(top_k == 0 || (static_cast<int64_t>(routers.size()) == L && static_cast<int64_t>(router_biases.size()) == L &&
                             top_k <= experts && matrices[2].dim() == 3 && matrices[3].dim() == 3),
              "decode_kernel.step: a mixture's router and bias per layer, its experts' matrices (E, out, in), top_k <= E");
  for (int64_t l = 0; top_k > 0 && l < L; ++l) {
    for (const auto& t : {routers.get(l), router_biases.get(l), biases.get(4 * l + 2), biases.get(4 * l + 3)}) {
      TORCH_CHECK(t && t->is_contiguous() && t->scalar_type() == wte.scalar_type() && t->size(0) == experts,
                  "decode_kernel.step: a mixture's router, its bias and its experts' biases in every layer");
    }
  }
  TORCH_CHECK(wte.is_contiguous() && (!wpe || (wpe->is_contiguous() && wpe->scalar_type() == wte.scalar_type())),
              "decode_kernel.step: wte and wpe in rows, of one dtype");
  const Dims dims{B, T, C, n_head, Hkv, D, cos[0].size(1), matrices[3].size(-1), matrices.back().size(0), L, past,
                  static_cast<float>(scale), static_cast<float>(softcap), static_cast<float>(logit_softcap),
                  static_cast<float>(embedding_scale), experts, top_k, static_cast<float>(clamp), static_cast<float>(alpha),
                  NormRule{norm == "layernorm", static_cast<float>(eps), static_cast<float>(norm_offset), norm_weight_in_float32},
                  qk_per_head, gated, activation_named(act), per_layer};
  const Args a{tokens, wte, wpe, norms, norm_biases, qk_norms, matrices, biases, scales, caches, cos, sin, alibi, sinks,
               routers, router_biases, dims};
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
  m.def("step(Tensor tokens, int past, Tensor wte, Tensor? wpe, Tensor?[] norms, Tensor?[] norm_biases, Tensor?[] qk_norms, "
        "Tensor[] matrices, Tensor?[] biases, Tensor?[] scales, Tensor(a!)[] caches, int[] layers, Tensor[] cos, Tensor[] sin, "
        "Tensor? alibi, Tensor?[] sinks, Tensor?[] routers, Tensor?[] router_biases, int n_head, float scale, float softcap, "
        "float logit_softcap, float embedding_scale, str norm, float eps, float norm_offset, bool norm_weight_in_float32, "
        "bool qk_per_head, str act, bool gated, int top_k, float clamp, float alpha) -> Tensor");
}
SELFATTN_IMPLEMENT(SELFATTN_NAMESPACE) {
  m.impl("step", &step);
}
