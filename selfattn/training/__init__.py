"""Training a GPT: corpora, the loop (one process, DDP, FSDP2), checkpoints (tokenizers are
:mod:`selfattn.tokenizers`).

- :mod:`selfattn.training.data`: corpora, the memory-mapped token cache, deterministic batches;
- :mod:`selfattn.training.config`: ``TrainConfig``, a run's settings, checked;
- :mod:`selfattn.training.presets`: named sizes of a run;
- :mod:`selfattn.training.resume`: which configs a run starts from, and what a resumed run keeps;
- :mod:`selfattn.training.loop`: :func:`~selfattn.training.loop.train`, the loop, its log and loss plot;
- :mod:`selfattn.training.parallel`: process groups, DDP/FSDP2 wrapping, reductions;
- :mod:`selfattn.training.checkpoint`: checkpoints written atomically and restored;
- :mod:`selfattn.training.evaluate`: a model's loss and perplexity on a text, over sliding contexts.
"""
