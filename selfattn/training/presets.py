"""Named sizes of a run (``selfattn train --preset NAME``): a model config and a train config each,
which ``--arch``, ``--config`` and the flags override (:func:`selfattn.training.resume.resolve_configs`)."""
from __future__ import annotations

# name -> (GPTConfig fields, TrainConfig fields); flags and --config override them.
PRESETS = {
    # 0.64M parameters: writes English-looking words in about a minute on 2 cores (README: its run)
    "tiny": (dict(block_size=128, n_layer=3, n_head=4, n_embd=128),
             dict(batch_size=16, max_steps=700, lr=3e-3, min_lr=3e-4, warmup_steps=50, eval_every=100,
                  eval_batches=8, save_every=350)),
    # nanoGPT's character-level Shakespeare size (~10.7M): minutes on one GPU
    "small": (dict(block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
              dict(batch_size=64, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100, eval_every=250,
                   save_every=1000, bf16=True)),
    # GPT-2 small's shape (124M) with a locally trained BPE: a large --data corpus, 8 GPUs under torchrun
    "gpt2": (dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
             dict(tokenizer="bpe", bpe_vocab=16384, batch_size=512, grad_accum=4, max_steps=5000, lr=6e-4,
                  min_lr=6e-5, warmup_steps=700, beta2=0.95, eval_every=250, save_every=1000, bf16=True)),
}
