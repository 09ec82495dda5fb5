"""selfattn: causal multi-head self-attention from scratch, exact, fast and verifiable.

The public names are imported on first use (a module ``__getattr__``, PEP 562), so that
``import selfattn.cli`` does not load torch: the command starts at once, and a Ctrl-C while
torch loads is the command's to report (one line, no traceback).
"""
import importlib

_PUBLIC = {"SelfAttention": "self_attention", "attention": "self_attention", "KVCache": "kv_cache",
           "Mask": "masks", "allowed": "masks", "GPT": "model", "GPTConfig": "config", "check_causal": "audit",
           "check_cache": "audit", "explore": "analysis.explore"}  # name -> the module that defines it
__all__ = ["SelfAttention", "attention", "KVCache", "Mask", "allowed", "GPT", "GPTConfig",
           "check_causal", "check_cache", "explore"]
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'selfattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"selfattn.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
