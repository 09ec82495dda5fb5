"""selfattn: causal multi-head self-attention from scratch, exact, fast and verifiable."""
from selfattn.analysis.explore import explore
from selfattn.attention import SelfAttention, attention
from selfattn.audit import check_cache, check_causal
from selfattn.kv_cache import KVCache
from selfattn.masks import Mask, allowed
from selfattn.model import GPT, GPTConfig

__all__ = ["SelfAttention", "attention", "KVCache", "Mask", "allowed", "GPT", "GPTConfig",
           "check_causal", "check_cache", "explore"]
__version__ = "0.1.0"
