"""Interpretability on every model the library loads: TransformerLens's hook sites, caches, the
logit lens and direct logit attribution, activation and attribution patching, head ablation
(``docs/interp.md``).

Above the model: it reaches the forward through the model's one generic hook point
(:attr:`selfattn.model.GPT.tap`); generation, the backends and the kernels know nothing of it.
"""
from selfattn.interp.ablation import ablate, random_heads
from selfattn.interp.attribution import Attribution, direct_logit_attribution, logit_lens
from selfattn.interp.attribution_patching import attribution_patch, rank_correlation
from selfattn.interp.patching import logit_diff, patch
from selfattn.interp.sites import hooks, run_with_cache, sites

__all__ = ["Attribution", "ablate", "attribution_patch", "direct_logit_attribution", "hooks", "logit_diff",
           "logit_lens", "patch", "random_heads", "rank_correlation", "run_with_cache", "sites"]
