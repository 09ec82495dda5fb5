"""Training a GPT: corpora, the loop (one process, DDP, FSDP2), checkpoints (tokenizers are
:mod:`selfattn.tokenizers`).

- :mod:`selfattn.training.data`: corpora, the memory-mapped token cache, deterministic batches;
- :mod:`selfattn.training.loop`: ``TrainConfig``, presets, :func:`~selfattn.training.loop.train`;
- :mod:`selfattn.training.parallel`: process groups, DDP/FSDP2 wrapping, reductions;
- :mod:`selfattn.training.checkpoint`: atomic safetensors checkpoints with a digest.
"""
