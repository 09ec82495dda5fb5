"""GGUF files (llama.cpp's format), read with the ``gguf`` package, llama.cpp's own reader.

:func:`read` turns a file into what the families of :mod:`selfattn.families` map:

- its metadata into a ``transformers``-style ``config.json`` dict (``general.architecture``
  ``llama`` is ``model_type`` llama, ``qwen2`` is qwen2; ``llama.embedding_length`` is ``hidden_size``, and so on,
  see ``_CONFIG``; no ``output.weight`` tensor means tied embeddings; bos/eos from the tokenizer's
  fields);
- its tensors into a lazy mapping under ``transformers``' names (``token_embd.weight`` is
  ``model.embed_tokens.weight``, ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight``,
  ...): a tensor is read and dequantised to float32 when it is looked up, one at a time; its shape
  is known without reading it. Every type ``gguf.quants`` dequantises is read (F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, the IQ types, ...).

llama.cpp's converter interleaves the rows of a Llama's ``attn_q`` and ``attn_k`` for its RoPE (not Qwen2's)
(each head's two rotated halves, pair by pair); they are put back in ``transformers``' order (first
half, then second half) by reading the quantised rows in that order, so no extra copy is made.

A file that is not GGUF, truncated, of an architecture or a tensor type not read here, or missing
a field the config needs, is one ValueError naming the file and the field or tensor; so is a damaged
one: a count (of tensors, of fields, of an array's entries) more than the rest of the file can hold,
a tensor whose bytes (by its type and shape) run into the next tensor's or past the end, a count of
the config that is not at least 1 or a width not divisible by the heads.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from selfattn._validate import one_line

MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # general.architecture -> the model_type it is
INTERLEAVED = {"llama"}  # the architectures whose q/k rows llama.cpp's converter interleaves for its RoPE
_REQUIRED = object()
# config.json key -> (the GGUF field after "<architecture>.", its kind, default: _REQUIRED when none)
_CONFIG = {
    "hidden_size": ("embedding_length", int, _REQUIRED),
    "num_hidden_layers": ("block_count", int, _REQUIRED),
    "num_attention_heads": ("attention.head_count", int, _REQUIRED),
    "num_key_value_heads": ("attention.head_count_kv", int, None),  # None: one per query head
    "intermediate_size": ("feed_forward_length", int, _REQUIRED),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", float, _REQUIRED),
    "rope_theta": ("rope.freq_base", float, 10000.0),
    "max_position_embeddings": ("context_length", int, _REQUIRED),
    "head_dim": ("attention.key_length", int, None),  # None: hidden_size / heads
}
_OUTSIDE = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_IN_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUF:
    """A GGUF file, read: its config as ``config.json`` says it, its tensors, its metadata."""
    path: Path
    config: dict  # a transformers config.json dict
    tensors: Tensors  # transformers' name -> float32 tensor, read when looked up
    metadata: Metadata


def read(path: str | Path) -> GGUF:
    """The GGUF file at ``path`` (see the module docstring); ValueError naming the file and field."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    reader = _reader(path)
    metadata = Metadata(reader, path)
    arch = metadata.value("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {arch!r} is not supported; this version reads "
                         f"{', '.join(ARCHITECTURES)} GGUF files")
    for t in reader.tensors:
        if not _dequantises(t.tensor_type):
            raise ValueError(f"{path}: tensor {t.name} is of type {t.tensor_type.name}, which gguf cannot "
                             f"dequantise (it reads {', '.join(_readable_types())})")
    config = _config(metadata, arch, reader)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]} \
        if arch in INTERLEAVED else {}
    return GGUF(path, config, Tensors(reader, path, heads), metadata)


class Metadata:
    """The metadata fields of a GGUF file as Python values, each error naming the file and field."""

    def __init__(self, reader, path: Path):
        self._fields, self.path = reader.fields, path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def value(self, key: str, kind: type | None = None, default=_REQUIRED):
        """The value of field ``key`` (a list for an array), checked to be a ``kind`` when given;
        ``default`` when the file lacks it, a ValueError naming it when there is no default."""
        if key not in self._fields:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: the GGUF metadata has no field {key}")
            return default
        try:
            value = self._fields[key].contents()
        except Exception as e:  # numpy's errors for a malformed field
            raise ValueError(f"{self.path}: metadata field {key} cannot be read ({one_line(e)})") from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.path}: metadata field {key} is {value!r}, expected a {kind.__name__}")
        return value


class Tensors(Mapping):
    """The tensors of a GGUF file under ``transformers``' names, each read and dequantised to
    float32 when looked up (``shape(name)`` says its shape without reading it)."""

    def __init__(self, reader, path: Path, heads: dict[str, int]):
        self._by_name = {hf_name(t.name): t for t in reader.tensors}
        self._path, self._heads = path, heads

    def __getitem__(self, name: str) -> Tensor:
        import gguf
        import numpy as np

        t = self._by_name[name]
        raw, heads = t.data, next((n for proj, n in self._heads.items() if f".{proj}." in name), None)
        if heads is not None:  # llama.cpp's interleaved q/k rows, read in transformers' order
            raw = raw[_rope_rows(raw.shape[0], heads, f"{self._path}: tensor {t.name}")]
        try:
            values = gguf.quants.dequantize(raw, t.tensor_type)
        except Exception as e:  # numpy's errors for a block that does not fit
            raise ValueError(f"{self._path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantised "
                             f"({one_line(e)})") from None
        values = values.astype(np.float32, copy=not values.flags.writeable)  # the file's memory map is read-only
        return torch.from_numpy(values.reshape(self.shape(name)))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._by_name[name].shape.tolist()))  # GGUF lists dims innermost first

    def gguf_name(self, name: str) -> str:
        return self._by_name[name].name

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


def hf_name(name: str) -> str:
    """``transformers``' name of the GGUF tensor ``name``; a name not mapped stays as it is (and is
    refused by the family's mapping as a tensor it does not expect)."""
    if name in _OUTSIDE:
        return _OUTSIDE[name]
    block = _BLOCK.fullmatch(name)
    if block and block.group(2) in _IN_BLOCK:
        return f"model.layers.{block.group(1)}.{_IN_BLOCK[block.group(2)]}.{block.group(3)}"
    return name


def _rope_rows(rows: int, heads: int, where: str):
    """The order to read llama.cpp's q or k rows in to get ``transformers``': per head, llama.cpp
    stores the rows of the two RoPE halves interleaved (row 2i of the first half, 2i+1 of the
    second); ``transformers`` stores the first half, then the second."""
    import numpy as np

    if rows % (2 * heads):
        raise ValueError(f"{where} has {rows} rows, not a multiple of 2 x {heads} heads")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _config(metadata: Metadata, arch: str, reader) -> dict:
    """The ``config.json`` dict of ``transformers`` that the file's metadata describes."""
    c = {"model_type": ARCHITECTURES[arch]}
    for key, (field, kind, default) in _CONFIG.items():
        c[key] = metadata.value(f"{arch}.{field}", kind, default)
        if kind is int and c[key] is not None and c[key] < 1:  # the counts, sizes and lengths
            raise ValueError(f"{metadata.path}: metadata field {arch}.{field} is {c[key]}, expected at least 1")
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    if c["head_dim"] is None and c["hidden_size"] % c["num_attention_heads"]:
        raise ValueError(f"{metadata.path}: {arch}.embedding_length {c['hidden_size']} is not divisible by "
                         f"{arch}.attention.head_count {c['num_attention_heads']} (and there is no "
                         f"{arch}.attention.key_length to give the head size)")
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    rotated = metadata.value(f"{arch}.rope.dimension_count", int, head_dim)
    if rotated != head_dim:
        raise ValueError(f"{metadata.path}: {arch}.rope.dimension_count is {rotated}, not the head size {head_dim}: "
                         f"RoPE on part of each head is not supported")
    scaling = metadata.value(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise ValueError(f"{metadata.path}: {arch}.rope.scaling.type {scaling!r} is not supported (RoPE without "
                         f"scaling only)")
    tokens = metadata.value("tokenizer.ggml.tokens", list, [])
    names = {t.name: t for t in reader.tensors}
    rows = int(names["token_embd.weight"].shape[-1]) if "token_embd.weight" in names else len(tokens)
    c["vocab_size"] = metadata.value(f"{arch}.vocab_size", int, rows)
    c["tie_word_embeddings"] = "output.weight" not in names
    for token in ("bos", "eos"):
        c[f"{token}_token_id"] = metadata.value(f"tokenizer.ggml.{token}_token_id", int, None)
    return c


class _Truncated(Exception):
    def __init__(self, offset: int, end: int):
        super().__init__(offset, end)
        self.offset, self.end = offset, end


class _Damaged(Exception):
    """What is wrong with the file, said in the message (the path goes before it)."""


def _reader(path: Path):
    """``gguf.GGUFReader`` of ``path``; a file that ends too soon names what it cuts, a count the
    rest of the file cannot hold names the count, tensors whose bytes overlap are named before any is read."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading a GGUF file needs the 'gguf' package: pip install 'selfattn[gguf]'") from e

    import numpy as np

    V = gguf.GGUFValueType

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):  # every read of the file goes through here
            dtype, count = np.dtype(dtype), int(count)
            end = int(offset) + dtype.itemsize * count
            if end > len(self.data):
                raise _Truncated(int(offset), end)
            if "plain" not in self.__dict__:  # the mapped bytes as a plain array: a memmap's slices cost far more
                self.plain = self.data.view(np.ndarray)
            arr = self.plain[int(offset):end].view(dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _fits(self, what: str, count, offset: int, things: str, least: int):
            """Refuse a count of ``things`` of ``least`` bytes or more that the file from ``offset`` cannot hold
            (a count damaged, or the file cut: which one, the file does not say)."""
            room = len(self.data) - offset
            if int(count) * least > room:
                raise _Damaged(f"truncated or damaged GGUF file ({len(self.data)} bytes): {what} is {int(count)}, "
                               f"but the {room} bytes from byte {offset} on hold at most {room // least} {things} "
                               f"(of {least} bytes or more each)")

        def _build_fields(self, offs, count):  # one at a time, so an array's length can name its field
            self._fits("GGUF.kv_count", count, offs, "metadata fields", 8 + 4 + 1)
            for _ in range(int(count)):
                self.key = None  # until its name is read
                self.key = str(bytes(self._get_str(offs)[1]), "utf-8", errors="replace")
                offs = super()._build_fields(offs, 1)
            return offs

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == V.ARRAY:
                kind, length = int(self._get(orig_offs, np.uint32)[0]), self._get(orig_offs + 4, np.uint64)[0]
                scalar = self.gguf_scalar_to_np.get(kind)
                # an entry's fewest bytes: a scalar's, a string's length, an array's type and length
                least = np.dtype(scalar).itemsize if scalar else {V.STRING: 8, V.ARRAY: 4 + 8}.get(kind, 1)
                self._fits(f"the array length of metadata field {self.key}", length, orig_offs + 12, "entries", least)
                if kind == V.STRING:
                    return self._strings(orig_offs, int(length))
                if scalar and length:  # the whole array as one part (the reader's own read makes one a value)
                    values = self._get(orig_offs + 12, scalar, length)
                    parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64), values]
                    return 12 + int(values.nbytes), parts, [2], [V.ARRAY, V(kind)]
            return super()._get_field_parts(orig_offs, raw_type)

        def _strings(self, orig_offs: int, length: int):
            """An array of ``length`` strings (a vocabulary, its merges) as the reader's parts, read in one
            pass over the bytes: each string a length and its bytes, as memoryviews (the reader's own
            read makes two arrays a string, seconds for a vocabulary of 49k tokens and its merges)."""
            data, order = memoryview(self.plain), "big" if self.byte_order == "S" else "little"
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            idxs, offs = [], orig_offs + 12
            for _ in range(length):
                if offs + 8 > len(data):
                    raise _Truncated(offs, offs + 8)
                end = offs + 8 + int.from_bytes(data[offs:offs + 8], order)
                if end > len(data):
                    raise _Truncated(offs + 8, end)
                parts += (data[offs:offs + 8], data[offs + 8:end])
                idxs.append(len(parts) - 1)
                offs = end
            return offs - orig_offs, parts, idxs, [V.ARRAY] + [V.STRING] * (length > 0)

        def _build_tensor_info(self, offs, count):
            self.describing = True  # the tensors' names, shapes and types, after the metadata
            self._fits("GGUF.tensor_count", count, offs, "tensor descriptions", 8 + 4 + 4 + 8)
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            self.tensor_infos = [(str(bytes(f.parts[1]), "utf-8"), start_offs + int(f.parts[5][0])) for f in fields]
            _check_ranges(self, start_offs, fields)
            return super()._build_tensors(start_offs, fields)

    reader = Reader.__new__(Reader)  # made first, so what it read before an error is still there
    try:
        reader.__init__(path)
    except _Truncated as e:
        raise ValueError(f"{path}: truncated GGUF file ({path.stat().st_size} bytes): {_cut(reader, e.offset)} "
                         f"needs bytes up to {e.end}") from None
    except _Damaged as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # the reader's own checks, numpy's errors for a malformed header
        raise ValueError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
    return reader


def _check_ranges(reader, start: int, fields) -> None:
    """Before any tensor is read: each tensor's bytes (as many as its type and shape say) end before
    the next tensor's begin, and before the end of the file; a tensor whose type or shape was
    damaged would otherwise read its neighbour's bytes."""
    import gguf

    ranges = []
    for f in fields:
        name, dims, raw_type = str(bytes(f.parts[1]), "utf-8"), [int(n) for n in f.parts[3]], int(f.parts[4][0])
        if raw_type not in gguf.GGML_QUANT_SIZES:
            raise _Damaged(f"tensor {name} is of type {raw_type}, which is no GGML tensor type")
        qtype = gguf.GGMLQuantizationType(raw_type)
        (block, size), shape = gguf.GGML_QUANT_SIZES[qtype], tuple(reversed(dims))
        if dims and dims[0] % block:
            raise _Damaged(f"tensor {name} ({qtype.name}, shape {shape}) has rows of {dims[0]} values, "
                           f"not whole blocks of {block}")
        offset, nbytes = start + int(f.parts[5][0]), math.prod(dims) // block * size
        ranges.append((offset, nbytes, name, f"{qtype.name}, shape {shape}"))
    ranges.sort()
    for (offset, size, name, kind), (after, _, neighbour, _) in zip(ranges, ranges[1:]):
        if offset + size > after:
            raise _Damaged(f"tensor {name} ({kind}: {size} bytes from byte {offset}) runs into tensor {neighbour} "
                           f"(from byte {after}): a type, shape or offset of the file is wrong")
    for offset, size, _, _ in ranges:
        if offset + size > len(reader.data):
            raise _Truncated(offset, offset + size)


def _cut(reader, offset: int) -> str:
    """What a read at ``offset`` that ran past the end was for: a tensor's data, the tensors'
    descriptions, a metadata field (the one after the last read, where its name is cut)."""
    infos = getattr(reader, "tensor_infos", None)
    if infos:
        return "tensor " + max((start, name) for name, start in infos if start <= offset)[1]
    if getattr(reader, "describing", False):
        return "the tensor descriptions after the metadata"
    if getattr(reader, "key", None):
        return f"the metadata field {reader.key}"
    fields = [name for name in getattr(reader, "fields", {}) if not name.startswith("GGUF.")]
    return f"the metadata field after {fields[-1]}" if fields else "the header"


@cache
def _dequantises(qtype) -> bool:
    """Whether ``gguf.quants`` dequantises tensors of ``qtype``: tried on one block of zeros."""
    import gguf
    import numpy as np

    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _readable_types() -> list[str]:
    import gguf

    return [t.name for t in gguf.GGMLQuantizationType if _dequantises(t)]
