"""Our tensor names to a folder's: one renaming table per family, one function for all of them.

A table maps a name of ours inside block i (a module, ``"attn.qkv"``, or a whole tensor,
``"attn.sinks"``) to the folder's name(s) inside its layer i; several names are stacked along
dim 0 (q, k, v into the fused ``qkv``). The names outside the blocks have a table of their own.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from selfattn.config import GPTConfig

_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")  # our names in block i


def sources(key: str, config: GPTConfig, *, outside: dict[str, str], layer: str,
            in_layer: dict[str, str | list[str]]) -> list[str]:
    """The folder's tensors that make our tensor ``key``: ``outside`` renames the tensors outside
    the blocks, ``layer`` is the folder's prefix of layer i (``"model.layers.{i}."``), ``in_layer``
    renames inside it (see the module docstring). A tied head is the embedding."""
    if key == "lm_head.weight" and config.tie_embeddings:
        key = "wte.weight"  # tied: the head is the embedding, which the folder stores once
    if key in outside:
        return [outside[key]]
    i, name = _LAYER.fullmatch(key).groups()
    prefix = layer.format(i=i)
    if name in in_layer:  # a tensor renamed whole
        theirs, suffix = in_layer[name], ""
    else:  # a module's weight or bias
        module, param = name.rsplit(".", 1)
        theirs, suffix = in_layer.get(module, module), "." + param
    return [prefix + t + suffix for t in ([theirs] if isinstance(theirs, str) else theirs)]


def layers(names: Iterable[str], layer: str) -> int:
    """How many layers the tensor ``names`` hold: the distinct i of the names under ``layer``, the
    folder's prefix of layer i (``"model.layers.{i}."``)."""
    before, _, after = layer.partition("{i}")
    pattern = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
    return len({int(m.group(1)) for m in map(pattern.match, names) if m})
