"""Training a GPT: tokenizers and corpora, the loop (one process, DDP, FSDP2), checkpoints.

- :mod:`selfattn.training.tokenizers`: byte and BPE tokenizers;
- :mod:`selfattn.training.data`: corpora, the memory-mapped token cache, deterministic batches;
- :mod:`selfattn.training.loop`: ``TrainConfig``, presets, :func:`~selfattn.training.loop.train`;
- :mod:`selfattn.training.parallel`: process groups, DDP/FSDP2 wrapping, reductions;
- :mod:`selfattn.training.checkpoint`: atomic safetensors checkpoints with a digest.
"""
