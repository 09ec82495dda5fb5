"""Small random models of every family ``transformers`` builds, for the parity and audit tests.

Each case has every option of its family on: a window shorter than the sequences, GQA, RoPE
scaling, soft-caps, sinks, experts; eager attention; every weight scrambled so a misplaced tensor
shows. Nothing is downloaded.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402  (the [hf] extra, part of [dev])

transformers.logging.set_verbosity_error()
V, T, W = 128, 80, 16  # vocabulary, logits length, the window of sliding layers (shorter than T)
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
CASES = {  # name -> (transformers' class prefix, what it sets beyond SIZES)
    "llama-llama3-rope": ("Llama", dict(head_dim=32, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "mistral": ("Mistral", dict(sliding_window=W)),
    "qwen2-some-layers-slide": ("Qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                              rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e6})),
    "qwen3": ("Qwen3", dict(head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=W,
                            layer_types=LAYERS, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                                 "original_max_position_embeddings": 32})),
    "gemma2": ("Gemma2", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3Text", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=16, layer_types=LAYERS,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6}})),
    "phi3": ("Phi3", dict(sliding_window=W, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 2.5],
        "long_factor": [3.0, 4.0, 6.0, 8.0]})),
    "olmo2": ("Olmo2", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "bloom": ("Bloom", dict(n_layer=3, n_head=4, hidden_size=64, vocab_size=V, bos_token_id=None,
                            eos_token_id=None)),
    "gpt-oss": ("GptOss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=W,
                               layer_types=LAYERS)),
}


def build(case: str, dtype=torch.float32, *, noise: float = 0.2, **overrides):
    """transformers' model of ``case`` in eval mode, every weight scrambled by ``noise`` (the same numbers
    for every dtype: drawn in float64, then cast)."""
    prefix, kw = CASES[case]
    sizes = {} if prefix == "Bloom" else SIZES
    config = getattr(transformers, f"{prefix}Config")(**{**sizes, **kw, **overrides}, attn_implementation="eager",
                                                      experts_implementation="eager")  # gpt-oss: a loop in float64 too
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert hf.config._attn_implementation == "eager"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            norm = "norm" in name and name.endswith("weight")  # a norm's scale near one, its shift near zero
            noise_ = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(noise_ * (noise / 2 if norm else noise) + (1.0 if norm else 0.0))
    return hf.to(dtype)


def tokens(B: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def assert_greedy_as_transformers(hf, ours, idx: torch.Tensor, n: int) -> None:
    """Our ``n`` greedy tokens through our caches equal ``transformers``' ``generate`` after ``idx``
    ``(B, T)``, and are not a degenerate repetition of one token."""
    from selfattn.generation import generate

    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)[:, idx.shape[1]:]
    got = torch.stack(list(generate(ours, idx, n, temperature=0)), 1)  # (B, n)
    assert torch.equal(got, theirs)
    assert len(set(got.flatten().tolist())) > 3
