// One decode step of a decoder whose blocks are Llama's, as one call: the embedding, every block and
// the head in one parallel region of the machine's threads, which meet at a barrier between the
// operations where each needs all of the one before (selfattn/decode_kernel.py says which models, and
// why). Included by stream_kernel.cpp inside its namespace: the products are its products_of, the
// attention its attend_tasks and merge_runs.
//
//   step(tokens (B, T), past, wte (V, C), norms, matrices, scales, caches, cos, sin, n_head, eps, scale)
//     -> logits (B * T, V) in wte's dtype A: each row's T tokens at positions past .. past + T - 1 (one in a
//        decode step, a few in a speculative verification), causal among themselves
//
// norms: each layer's two RMSNorm weights (C,), then the final one; matrices: each layer's qkv
// ((H + 2 Hkv) D, C), proj (C, H D), gate_up (2 I, C) and down (C, I), then the head (V, C), all of
// one dtype W (A, or int8 with a float32 scale (out,) each in scales); caches: each layer's k and v
// (B, Hkv, max_len, D) in A, the tokens written at slots past ..; cos and sin (positions, R / 2) float32,
// the rotary angles of the first R channels of each head (their attention factor in them).
//
// Every value is rounded to A where the model's own step rounds it (a tensor of A holds it): the
// residual stream, each norm before and after its weight, each product, the rotated q and k, the
// attention's output, SiLU and its product with up. So a float32 step sums as the model's does up to
// the order of a few sums (the norms' mean of squares), and a half-precision one rounds as its eager
// step does, not as a fused graph does.

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
};

template <typename A, typename W>
struct Weights {
  const A* wte;
  std::vector<const A*> norms;         // 2 per layer, then the final one
  std::vector<const W*> matrices;      // 4 per layer (qkv, proj, gate_up, down), then the head
  std::vector<const float*> scales;    // one per matrix, nullptr but for int8
  std::vector<A*> caches;              // k, v per layer
  const float *cos, *sin;              // the angles of every position, half each
};

// X: the products' rows, float32 (holding values of A) or bfloat16 where the CPU pairs them with a bfloat16 matrix
template <typename A, typename W, typename X>
void decode(const Weights<A, W>& m, const Dims& d, const int64_t* tokens, A* logits) {
  const int64_t T = d.T, N = d.B * T, C = d.C, H = d.H, Hkv = d.Hkv, D = d.D, I = d.I, g = H / Hkv;  // N rows: every token
  const int64_t QKV = (H + 2 * Hkv) * D, S = d.past + T, runs = (S + KEYS - 1) / KEYS, tasks = d.B * Hkv * runs;
  std::vector<A> x(N * C), qkv(N * QKV), y(N * C), gate_up(N * 2 * I), heads(N * H * D);  // heads (B, H, T, D)
  std::vector<X> h(N * C), att(N * H * D), act(N * I);
  std::vector<float> q(N * H * D), parts(tasks * g * T * (D + 2)), rotated(D);  // q (B, H, T, D)
  const int64_t cache_strides[4] = {Hkv * d.max_len * D, d.max_len * D, D, 1};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const auto mine = [&](int64_t total) {  // this thread's part [begin, end) of total
      return std::pair<int64_t, int64_t>{total * thread / threads, total * (thread + 1) / threads};
    };
    const auto product = [&](const W* w, const float* scale, const X* in, int64_t width, A* out, int64_t out_width) {
      const auto [begin, end] = mine(out_width);  // this thread's matrix rows, for every row of in
      products_of(w, in, scale, out, N, out_width, width, begin, end);
    };
    const auto add_and_norm = [&](const A* norm) {  // x += y, h = norm(x): one thread, then a barrier
#pragma omp single
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t c = i * C; c < (i + 1) * C; ++c) x[c] = static_cast<A>(static_cast<float>(x[c]) + static_cast<float>(y[c]));
        rms_norm(x.data() + i * C, norm, C, d.eps, h.data() + i * C);
      }
    };
#pragma omp single
    for (int64_t i = 0; i < N; ++i) {
      std::copy(m.wte + tokens[i] * C, m.wte + (tokens[i] + 1) * C, x.data() + i * C);
      rms_norm(x.data() + i * C, m.norms[0], C, d.eps, h.data() + i * C);
    }
    for (int64_t l = 0; l < d.layers; ++l) {
      const W* const* w = m.matrices.data() + 4 * l;
      const float* const* scale = m.scales.data() + 4 * l;
      A *kc = m.caches[2 * l], *vc = m.caches[2 * l + 1];
      product(w[0], scale[0], h.data(), C, qkv.data(), QKV);
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
      product(w[1], scale[1], att.data(), H * D, y.data(), C);
#pragma omp barrier
      add_and_norm(m.norms[2 * l + 1]);
      product(w[2], scale[2], h.data(), C, gate_up.data(), 2 * I);
#pragma omp barrier
      {
        const auto [begin, end] = mine(N * I);
        for (int64_t i = begin; i < end; ++i) {  // SiLU(gate) * up, each rounded to A
          const A* row = gate_up.data() + i / I * 2 * I;
          const float gate = static_cast<float>(row[i % I]), up = static_cast<float>(row[I + i % I]);
          act[i] = static_cast<X>(as_stored<A>(as_stored<A>(gate / (1.0f + std::exp(-gate))) * up));
        }
      }
#pragma omp barrier
      product(w[3], scale[3], act.data(), I, y.data(), C);
#pragma omp barrier
      add_and_norm(m.norms[2 * l + 2]);  // the next layer's first norm, or the final one
    }
    product(m.matrices.back(), m.scales.back(), h.data(), C, logits, d.V);
  }
}

template <typename A, typename W>
at::Tensor decode_as(const at::Tensor& tokens, int64_t past, const at::Tensor& wte, at::TensorList norms, at::TensorList matrices,
                     const c10::List<std::optional<at::Tensor>>& scales, at::TensorList caches, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t n_head, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  Weights<A, W> m{wte.data_ptr<A>(), {}, {}, {}, {}, cos.data_ptr<float>(), sin.data_ptr<float>()};
  for (const at::Tensor& w : norms) m.norms.push_back(w.data_ptr<A>());
  for (int64_t i = 0; i < static_cast<int64_t>(matrices.size()); ++i) {
    m.matrices.push_back(matrices[i].data_ptr<W>());
    const std::optional<at::Tensor> s = scales.get(i);
    m.scales.push_back(s ? s->data_ptr<float>() : nullptr);
  }
  for (const at::Tensor& c : caches) m.caches.push_back(c.data_ptr<A>());
  const at::Tensor& k = caches[0];
  const Dims d{tokens.size(0), tokens.size(1), wte.size(1), n_head, k.size(1), k.size(3), cos.size(1), matrices[2].size(0) / 2,
               matrices.back().size(0), layers, k.size(2), past, static_cast<float>(eps), static_cast<float>(scale)};
  at::Tensor logits = at::empty({d.B * d.T, d.V}, wte.options());
  const at::Tensor ids = tokens.contiguous();
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
at::Tensor decode_with(const at::Tensor& tokens, int64_t past, const at::Tensor& wte, at::TensorList norms, at::TensorList matrices,
                       const c10::List<std::optional<at::Tensor>>& scales, at::TensorList caches, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t n_head, double eps, double scale) {
  if (matrices[0].scalar_type() == at::kChar) {
    return decode_as<A, int8_t>(tokens, past, wte, norms, matrices, scales, caches, cos, sin, n_head, eps, scale);
  }
  return decode_as<A, A>(tokens, past, wte, norms, matrices, scales, caches, cos, sin, n_head, eps, scale);
}

at::Tensor step(const at::Tensor& tokens, int64_t past, const at::Tensor& wte, at::TensorList norms, at::TensorList matrices,
                const c10::List<std::optional<at::Tensor>>& scales, at::TensorList caches, const at::Tensor& cos,
                const at::Tensor& sin, int64_t n_head, double eps, double scale) {
  // the caller (decode_kernel.py) has checked the model; these hold it to what this file reads
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(matrices.size()) == 4 * layers + 1 &&
                  static_cast<int64_t>(norms.size()) == 2 * layers + 1 && static_cast<int64_t>(scales.size()) == 4 * layers + 1,
              "decode_kernel.step: 2 norms, 4 matrices and k, v per layer, a final norm and the head");
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat &&
                  past + tokens.size(1) <= cos.size(0) && past + tokens.size(1) <= caches[0].size(2),
              "decode_kernel.step: tokens (B, T) int64, float32 angles and slots for positions ", past, " + T");
  for (const at::Tensor& w : matrices) {
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == matrices[0].scalar_type(), "decode_kernel.step: matrices of one dtype, in rows");
  }
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.is_contiguous() && c.sizes() == caches[0].sizes() && c.scalar_type() == wte.scalar_type(),
                "decode_kernel.step: contiguous caches alike, in the embedding's dtype");
  }
  switch (wte.scalar_type()) {
    case at::kFloat: return decode_with<float>(tokens, past, wte, norms, matrices, scales, caches, cos, sin, n_head, eps, scale);
    case at::kBFloat16: return decode_with<c10::BFloat16>(tokens, past, wte, norms, matrices, scales, caches, cos, sin, n_head, eps, scale);
    case at::kHalf: return decode_with<c10::Half>(tokens, past, wte, norms, matrices, scales, caches, cos, sin, n_head, eps, scale);
    default: TORCH_CHECK(false, "decode_kernel.step: a model of ", wte.scalar_type(), " (float32, bfloat16 or float16)");
  }
}
