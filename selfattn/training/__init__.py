"""Training a GPT: corpora, the loop (one process, DDP, FSDP2), checkpoints (tokenizers are
:mod:`selfattn.tokenizers`).

- :mod:`selfattn.training.data`: corpora, the memory-mapped token cache, deterministic batches;
- :mod:`selfattn.training.loop`: ``TrainConfig``, presets, :func:`~selfattn.training.loop.train`;
- :mod:`selfattn.training.parallel`: process groups, DDP/FSDP2 wrapping, reductions;
- :mod:`selfattn.training.checkpoint`: checkpoints written atomically and restored;
- :mod:`selfattn.training.evaluate`: a model's loss and perplexity on a text, over sliding windows.
"""
