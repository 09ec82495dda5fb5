"""The settings of a training run: :class:`TrainConfig`, each field with its help (the flags of
``selfattn train`` are made from them), checked when one is made."""
from __future__ import annotations

from dataclasses import dataclass

from selfattn._util import validate as _validate
from selfattn._util.fields import described


@dataclass
class TrainConfig:
    data: str | None = described(None, "text file or folder of text files; none = the built-in corpus (Python's docs)")
    init_from: str | None = described(None, "start from a model selfattn loads (a run, a transformers folder, a GGUF "
                                            "file): its weights, its config (flags change it) and its tokenizer")
    tokenizer: str = described("byte", '"byte" (vocabulary 256, any text) or "bpe" (trained locally on the corpus)')
    bpe_vocab: int = described(2048, 'BPE vocabulary size (256 bytes + merges), with tokenizer "bpe"')
    val_fraction: float = described(0.1, 'the last fraction of the tokens, held out for evaluation')
    seq_len: int | None = described(None, "tokens per training row; none = the model's block_size (fine-tuning a "
                                          "long-context model on shorter rows keeps its context)")
    batch_size: int = described(32, 'sequences per optimizer step, over all ranks and micro-steps together')
    grad_accum: int = described(1, 'micro-steps per optimizer step: each runs batch_size / (ranks * grad_accum) rows')
    max_steps: int = described(2000, 'optimizer steps; the cosine decay ends here')
    lr: float = described(1e-3, 'peak learning rate, reached after the warmup')
    min_lr: float = described(1e-4, 'learning rate at the end of the cosine decay')
    warmup_steps: int = described(100, 'linear warmup from 0 to lr over these steps')
    weight_decay: float = described(0.1, 'AdamW weight decay, on matrices only (not on biases and LayerNorm gains)')
    beta1: float = described(0.9, 'AdamW beta1')
    beta2: float = described(0.99, 'AdamW beta2')
    grad_clip: float = described(1.0, 'clip the global gradient norm to this; 0 = no clipping')
    eval_every: int = described(200, 'steps between evaluations on the val split (also redraws loss.png)')
    eval_batches: int = described(20, 'batches per evaluation, the same batches every time')
    save_every: int = described(500, 'steps between checkpoints; the last step is always saved')
    keep: int = described(2, 'checkpoints kept in the run folder, the newest ones')
    seed: int = described(0, 'seeds the initial weights, the batches and the dropout masks')
    device: str = described("auto", '"auto" (CUDA if available, else CPU) or a torch device: "cpu", "cuda", "mps"')
    bf16: bool = described(False, 'bfloat16 autocast for forward and backward; weights and AdamW state stay float32')
    general_data: str | None = described(None, "with --init-from: a text the model's loss is measured on at every "
                                               "evaluation, beside the task's, to catch forgetting; none = the "
                                               "built-in corpus (Python's docs)")
    general_tokens: int = described(2048, "with --init-from: tokens of general_data measured each time; 0 = no "
                                          "general check")
    lora_rank: int | None = described(None, "with --init-from: train LoRA adapters of this rank on the attention "
                                            "projections, every weight of the model frozen; none = train all weights")
    lora_alpha: float | None = described(None, "LoRA's scale is alpha / rank; none = 2 * rank")
    lora_dropout: float = described(0.0, "dropout on the LoRA adapters' input")
    lora_mlp: bool = described(False, "LoRA adapters on the MLP's projections too")
    pack: bool = described(False, "chat data: pack conversations into rows as separate documents (positions "
                                  "restart, no attention across them) instead of one padded row each")
    compile: bool = described(False, 'torch.compile the model')
    checkpoint_activations: bool = described(False, "recompute each block's activations in the backward instead of "
                                                    "keeping them: less memory for one more forward of the blocks")
    fsdp: bool = described(False, 'under torchrun: shard the model with FSDP2 instead of replicating it with DDP')
    context_parallel: int = described(1, 'under torchrun: split each sequence over this many ranks (ring attention)')

    def __post_init__(self):
        _validate.positive_ints(**{name: getattr(self, name) for name in (
            "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "save_every", "keep", "bpe_vocab",
            "context_parallel")})
        if self.context_parallel > 1 and (self.fsdp or self.compile):
            raise ValueError(f"context_parallel={self.context_parallel} runs with DDP, eagerly: not with "
                             f"{'fsdp' if self.fsdp else 'compile'}")
        _validate.count("warmup_steps", self.warmup_steps)
        _validate.count("general_tokens", self.general_tokens)
        if self.init_from is None and self.general_data is not None:
            raise ValueError("general_data measures what a fine-tune forgets: give --init-from too")
        if self.seq_len is not None:
            _validate.positive_int("seq_len", self.seq_len)
        if self.pack and self.context_parallel > 1:
            raise ValueError("pack and context_parallel: packed documents are not split over ranks")
        if self.lora_rank is not None:
            _validate.positive_int("lora_rank", self.lora_rank)
        if self.lora_alpha is not None:
            _validate.positive_number("lora_alpha", self.lora_alpha)
        _validate.probability("lora_dropout", self.lora_dropout)
        if self.init_from is None and (self.lora_rank is not None or self.lora_mlp):
            raise ValueError("LoRA adapts a loaded model: give --init-from with --lora-rank")
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_mlp or self.lora_dropout):
            raise ValueError("lora_alpha, lora_dropout and lora_mlp set LoRA's adapters: give --lora-rank too")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {self.tokenizer!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"init_from must be a path, got {self.init_from!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")
