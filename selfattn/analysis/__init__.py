"""Looking inside attention: head capture and role scores, the induction and scaling
experiments, the seed's worked example.

- :mod:`selfattn.analysis.heads`: :func:`capture` attention weights, score head roles, plot them;
- :mod:`selfattn.analysis.induction`: a two-layer attention-only GPT learns to copy;
- :mod:`selfattn.analysis.scaling`: why scores are scaled by 1/sqrt(head_dim);
- :mod:`selfattn.analysis.worked_example`: the seed document's example, computed live.
"""
from selfattn.analysis.heads import attention_maps, capture, head_scores

__all__ = ["capture", "attention_maps", "head_scores"]
