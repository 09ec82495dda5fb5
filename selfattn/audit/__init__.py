"""The causality auditor: does any output depend on an input it must not see?

- :func:`check_causal` (:mod:`selfattn.audit.causality`): perturbation and float64 jacobian;
- :func:`check_cache` (:mod:`selfattn.audit.cache`): cached decoding against the full forward;
- :mod:`selfattn.audit.suite`: the audits ``selfattn check`` runs;
- :mod:`selfattn.audit.parity`: a backend against the math oracle (the FlashAttention rule).
"""
from selfattn.audit.cache import CacheReport, check_cache
from selfattn.audit.causality import CausalityReport, check_causal, hf_adapter

__all__ = ["check_causal", "check_cache", "hf_adapter", "CausalityReport", "CacheReport"]
