"""selfattn: causal multi-head self-attention from scratch, exact, fast and verifiable."""
from selfattn.attention import SelfAttention, attention
from selfattn.kv_cache import KVCache
from selfattn.masks import Mask, allowed

__all__ = ["SelfAttention", "attention", "KVCache", "Mask", "allowed"]
__version__ = "0.1.0"
