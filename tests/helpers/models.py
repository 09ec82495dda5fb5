"""Small models shared by the model, generation and transformers tests."""
import torch

from selfattn.model import GPT, GPTConfig

BACKENDS = ["math", "sdpa", "tiled"]
VARIANTS = {  # name -> GPTConfig overrides
    "learned": {},
    "rope": {"pos": "rope"},
    "gqa-window": {"n_kv_head": 2, "window": 4},
    "rope-gqa-window-bias": {"pos": "rope", "n_kv_head": 1, "window": 3, "bias": True},
    "alibi-window": {"pos": "none", "alibi": True, "n_kv_head": 2, "window": 5},
    "llama-shaped": {"pos": "rope", "norm": "rmsnorm", "mlp_kind": "swiglu", "intermediate_size": 48, "head_dim": 16,
                     "n_kv_head": 2, "qkv_bias": True, "tie_embeddings": False, "window": 6},
}


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



def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into idx (B, T) and attention_mask (B, T)."""
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return idx, mask
