"""Small models shared by the model, generation and transformers tests."""
import dataclasses
from pathlib import Path

import torch

from selfattn.config import GPTConfig
from selfattn.model import GPT

BACKENDS = ["math", "sdpa", "tiled"]
VARIANTS = {  # name -> GPTConfig overrides
    "learned": {},
    "rope": {"pos": "rope"},
    "gqa-window": {"n_kv_head": 2, "window": 4},
    "rope-gqa-window-bias": {"pos": "rope", "n_kv_head": 1, "window": 3, "bias": True},
    "alibi-window": {"pos": "none", "alibi": True, "n_kv_head": 2, "window": 5},
    "llama-shaped": {"pos": "rope", "norm": "rmsnorm", "mlp_kind": "swiglu", "intermediate_size": 48, "head_dim": 16,
                     "n_kv_head": 2, "qkv_bias": True, "tie_embeddings": False, "window": 6},
    "gemma-shaped": {"pos": "rope", "norm": "rmsnorm", "norm_offset": 1.0, "norm_weight_in_float32": True,
                     "norm_position": "sandwich", "mlp_kind": "geglu", "intermediate_size": 48, "head_dim": 16,
                     "n_kv_head": 2, "qk_norm": "head", "attn_scale": 0.3, "softcap": 5.0, "logit_softcap": 8.0,
                     "embedding_scale": 32 ** 0.5, "window": 5, "window_layers": [True, False],
                     "window_rope_base": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "post-norm-experts-sinks": {"pos": "rope", "norm": "rmsnorm", "norm_weight_in_float32": True,
                                "norm_position": "post", "qk_norm": "projection", "mlp_kind": "moe", "n_experts": 4,
                                "intermediate_size": 24, "sinks": True, "rope_dims": 4, "rope_scaling": {
                                    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}},
    "bloom-shaped": {"pos": "none", "alibi": True, "bias": True, "embedding_norm": True},
}
# every (variant, backend) pair a backend serves: SDPA computes no soft-capping or sinks (and says so)
PAIRS = [(v, b) for v in VARIANTS for b in BACKENDS
         if not (b == "sdpa" and (VARIANTS[v].get("softcap") or VARIANTS[v].get("sinks")))]


def small(**kw) -> GPTConfig:
    base = dict(vocab_size=61, block_size=24, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


def scrambled(config: GPTConfig) -> GPT:
    """A model with every parameter random and O(1) logits: a wrong position, mask or weight
    shows up clearly (GPT-2's init leaves LayerNorms at 1/0 and logits near 0)."""
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = 1.0 if "ln" in name and "weight" in name else 0.0  # LayerNorm gains near 1
            p.copy_(torch.randn_like(p) * (0.1 if "ln" in name else 0.3) + gain)
    return model


ORDER_ROUNDING = 4e-6  # float32: two orders of the same sums differ by up to ~1.6e-6 of the largest logit


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 logits of one computation done two ways (cached or batched, another backend or
    library): equal up to the rounding of sums taken in another order, which grows with the
    logits' size: ``ORDER_ROUNDING`` of their largest magnitude (at least 1e-5). A wrong
    position, mask or weight moves logits by orders of magnitude more."""
    bound = ORDER_ROUNDING * max(expected.abs().max().item(), 2.5)
    torch.testing.assert_close(actual, expected, rtol=0, atol=bound)


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into idx (B, T) and attention_mask (B, T)."""
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return idx, mask


def byte_run(folder: Path, config: GPTConfig) -> GPT:
    """A random byte-level GPT of ``config`` (drawn after ``torch.manual_seed(0)``) saved as the run folder
    ``folder`` (one checkpoint, step 1), as the commands load it; the model, in eval mode."""
    from selfattn.training import checkpoint

    torch.manual_seed(0)
    model = GPT(config)
    checkpoint.save(folder, 1, model, torch.optim.AdamW(model.parameters()), keep=1,
                    meta={"model": dataclasses.asdict(config), "tokenizer": {"kind": "byte"}, "step": 1})
    return model.eval()
