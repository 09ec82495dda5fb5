"""selfattn: causal multi-head self-attention from scratch, exact, fast and verifiable.

The public names are imported on first use, so that ``import selfattn.cli`` does not load
torch: the command starts at once, and a Ctrl-C while torch loads is the command's to report
(one line, no traceback).
"""
import importlib
import sys
import types

_PUBLIC = {"SelfAttention": "attention", "attention": "attention", "KVCache": "kv_cache", "Mask": "masks",
           "allowed": "masks", "GPT": "model", "GPTConfig": "config", "check_causal": "audit",
           "check_cache": "audit", "explore": "analysis.explore"}  # name -> the module that defines it
__all__ = ["SelfAttention", "attention", "KVCache", "Mask", "allowed", "GPT", "GPTConfig",
           "check_causal", "check_cache", "explore"]
__version__ = "0.1.0"


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _PUBLIC:
            raise AttributeError(f"module 'selfattn' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"selfattn.{_PUBLIC[name]}"), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name, value):
        # importing the submodule selfattn.attention binds it here: the function keeps the name
        if not (name in _PUBLIC and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_PUBLIC))


sys.modules[__name__].__class__ = _Package
