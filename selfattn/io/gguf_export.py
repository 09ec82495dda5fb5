"""A model as a GGUF file that llama.cpp runs, checked by reading it back.

``export_gguf(gpt, tokenizer, out)`` writes the file (:mod:`selfattn.formats.gguf_write`) under a temporary
name beside ``out``, reads it back with the loader every command uses (:func:`selfattn.io.loading.load`),
and renames it into place only when the model read back is the model written: the same decoder, field for
field (its float fields, an epsilon say, as float32, as the file stores them; a RoPE rule the same rotations
however it is written; biases the model lacks and the file holds as zeros, the same function). What the file
cannot say is refused, naming each field and both values. Its float32 logits are compared with ours on
:data:`~selfattn.io.export.PROBE_TOKENS` tokens (F32: the same; F16, BF16 and Q8_0: what rounding the weights
costs). A kill leaves the old file or the new one, never part of one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from selfattn._util import files as _files
from selfattn._util import progress
from selfattn.families import writing
from selfattn.formats import gguf_write
from selfattn.io.export import Special, logits_error
from selfattn.io.loading import load
from selfattn.model import GPT
from selfattn.rope import rope_angles


@dataclass
class ExportedGGUF:
    """What :func:`export_gguf` wrote."""
    path: Path
    written: gguf_write.Written  # its architecture, tensor types and tokenizer
    type: str  # the type its matrices were asked in (gguf_write.TYPES)
    logits_error: float  # max |logit difference|, the file read back (float32) vs ours, on PROBE_TOKENS tokens
    model: GPT  # the file read back, dequantised to float32, in eval mode


def export_gguf(gpt: GPT, tokenizer, out: str | os.PathLike, *, type: str = "f32", special: Special | None = None,
                source: str | os.PathLike | None = None) -> ExportedGGUF:
    """Write ``gpt`` and ``tokenizer`` to the GGUF file ``out`` (replaced if it exists), its matrices in
    ``type``, with ``special``'s bos, eos, chat template and pre-tokenizer name; ``source``: where the model came
    from (a GGUF source gives its tokenizer fields). The folders above ``out`` are created. A ValueError, the
    file left as it was, for a model llama.cpp's architectures cannot say, or one the file would say otherwise
    (each field named)."""
    special = special or Special()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)  # as a folder export makes its parents
    with _files.atomic_path(out) as tmp:
        written = gguf_write.write(gpt, tokenizer, tmp, type=type, bos=special.bos, eos=special.eos,
                                   chat_template=special.chat_template, source=source, pre=special.pre)
        back = load(tmp).model.eval()  # its progress: the loader's
        written_config = writing.with_biases(gpt.config) if written.zero_biases else gpt.config  # zeros: the same
        ours, theirs = (_as_float32(writing.computes(c)) for c in (written_config, back.config))
        differ = [f"{name}={ours[name]!r} (the file says {theirs[name]!r})" for name in ours
                  if ours[name] != theirs[name] and not (name == "rope_base" and _same_rope(gpt.config, back.config))]
        if differ:
            raise ValueError(f"llama.cpp's {written.architecture} file cannot say this model: " + "; ".join(differ))
        with progress.stage("checking its logits"):
            error = logits_error(gpt, lambda idx: back(idx.cpu())[0].to(idx.device))  # back is on the CPU
    return ExportedGGUF(out, written, type, error, back)


def _same_rope(a, b) -> bool:
    """Whether the configs ``a`` and ``b`` rotate every layer's queries and keys alike (one rule may be written
    two ways: a YaRN attention factor left to its default or said), on up to 513 positions of the context."""
    positions = torch.arange(0, a.block_size, max(1, a.block_size // 512)).tolist() + [a.block_size - 1]
    rotated = a.rope_dims or a.head_dim or a.n_embd // a.n_head
    for i in range(a.n_layer):
        (base_a, rule_a), (base_b, rule_b) = a.layer_rope(i), b.layer_rope(i)
        angles = [torch.cat(rope_angles(torch.tensor(positions), rotated, base, scaling=rule))
                  for base, rule in ((base_a, rule_a), (base_b, rule_b))]
        if not torch.allclose(*angles, rtol=0, atol=1e-4):  # a rule's factors are float32
            return False
    return True


def _as_float32(value):
    """``value`` (a dict of config fields) with every float rounded to float32, as a GGUF file stores it."""
    if isinstance(value, dict):
        return {k: _as_float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_float32(v) for v in value)
    return float(torch.tensor(value, dtype=torch.float32)) if isinstance(value, float) else value
