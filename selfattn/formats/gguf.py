"""GGUF files (llama.cpp's format), read with the ``gguf`` package, llama.cpp's own reader.

:func:`read` turns a file into what the families of :mod:`selfattn.families` map, by the names and fixes
the family of its ``general.architecture`` declares (its ``GGUF``, :mod:`selfattn.families._gguf`):

- its metadata into a ``transformers``-style ``config.json`` dict (``gemma3`` is ``model_type`` gemma3_text,
  ``gemma3.embedding_length`` is ``hidden_size``, and so on; what llama.cpp derives by rule rather than
  reads, the family derives alike, and what it computes one way whatever the file says (GPT-2's GELU, Phi-3's
  window: none), the family fixes alike; the RoPE rule as llama.cpp reads it, its per-frequency factors tensors
  included (:func:`selfattn.families._gguf.rope`); no ``output.weight`` tensor means tied embeddings;
  bos/eos from the tokenizer's fields);
- its tensors into a lazy mapping under ``transformers``' names (``token_embd.weight`` is
  ``model.embed_tokens.weight``, ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight``,
  ...): a tensor is read and dequantised to float32 when it is looked up, one at a time; its shape
  is known without reading it. Every type ``gguf.quants`` dequantises is read (F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, the IQ types, ...), the common ones by
  :mod:`~selfattn.formats.ggml_blocks` (vectorised in PyTorch, equal to ggml's to the bit).

The converter's fixes are undone as a tensor is read: a norm weight stored with an offset (Gemma's 1) gets
it taken off; the rows of ``attn_q`` and ``attn_k`` that it interleaves for llama.cpp's RoPE (a Llama's,
not Qwen2's: each head's two rotated halves, pair by pair) are put back in ``transformers``' order (first
half, then second half) by reading the quantised rows in that order, so no extra copy is made; so are the
rows of a fused q, k, v that it regroups as q, k, v apart (BLOOM's, per head in ``transformers``). A tensor
it stores transposed is transposed back, one it splits into two halves (gpt-oss's experts' gate and up,
alternated in ``transformers``) is read whole from both.

A file that is not GGUF, truncated, of an architecture or a tensor type not read here, or missing
a field the config needs, is one ValueError naming the file and the field or tensor; so is a damaged
one: a count (of tensors, of fields, of an array's entries) more than the rest of the file can hold,
a tensor whose bytes (by its type and shape) run into the next tensor's or past the end, a count of
the config that is not at least 1 or a width not divisible by the heads.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util.validate import one_line
from selfattn.families import FAMILIES, GGUF_ARCHITECTURES
from selfattn.families._gguf import REQUIRED, ROPE_TENSORS, FieldError, rope
from selfattn.formats import ggml_blocks

MAGIC = b"GGUF"  # the first four bytes of every GGUF file


@dataclass
class GGUF:
    """A GGUF file, read: its config as ``config.json`` says it, its tensors, its metadata."""
    path: Path
    config: dict  # a transformers config.json dict
    tensors: Tensors  # transformers' name -> float32 tensor, read when looked up
    metadata: Metadata


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does (:data:`MAGIC`), whatever its name."""
    return Path(path).is_file() and _head(Path(path)) == MAGIC


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(len(MAGIC))


def read(path: str | Path) -> GGUF:
    """The GGUF file at ``path`` (see the module docstring); ValueError naming the file and field."""
    path = Path(path)
    if (head := _head(path)) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    reader = _reader(path)
    metadata = Metadata(reader, path)
    arch = metadata.value("general.architecture", str)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {arch!r} is not supported; this version reads "
                         f"{', '.join(GGUF_ARCHITECTURES)} GGUF files")
    names = FAMILIES[GGUF_ARCHITECTURES[arch]].GGUF
    for t in reader.tensors:
        if not _dequantises(t.tensor_type):
            raise ValueError(f"{path}: tensor {t.name} is of type {t.tensor_type.name}, which gguf cannot "
                             f"dequantise (it reads {', '.join(_readable_types())})")
    config = _config(metadata, arch, names, reader)
    orders = {"attn_q": (_rope_rows, config["num_attention_heads"]),
              "attn_k": (_rope_rows, config["num_key_value_heads"])} if arch in names.interleaved else {}
    orders |= {module: (_head_rows, config["num_attention_heads"]) for module in names.by_head}
    return GGUF(path, config, Tensors(reader, path, names, orders), metadata)


class Metadata:
    """The metadata fields of a GGUF file as Python values, each error naming the file and field."""

    def __init__(self, reader, path: Path):
        self._fields, self._strings, self.path = reader.fields, reader.strings, path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def value(self, key: str, kind: type | None = None, default=REQUIRED):
        """The value of field ``key`` (a list for an array), checked to be a ``kind`` when given;
        ``default`` when the file lacks it, a ValueError naming it when there is no default."""
        if key not in self._fields:
            if default is REQUIRED:
                raise ValueError(f"{self.path}: the GGUF metadata has no field {key}")
            return default
        try:
            value = list(self._strings[key]) if key in self._strings else self._fields[key].contents()
        except Exception as e:  # numpy's errors for a malformed field
            raise ValueError(f"{self.path}: metadata field {key} cannot be read ({one_line(e)})") from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.path}: metadata field {key} is {value!r}, expected a {kind.__name__}")
        return value


class Tensors(Mapping):
    """The tensors of a GGUF file under ``transformers``' names (the family's ``names``), each read and
    dequantised to float32 when looked up, the converter's fixes undone (``shape(name)`` says its shape
    without reading it); the RoPE factors (:data:`~selfattn.families._gguf.ROPE_TENSORS`) are the config's,
    not weights. ``orders``: llama.cpp's in-block module -> (the rule of the order to read its rows in, the
    heads), where the converter reordered them."""

    def __init__(self, reader, path: Path, names, orders: dict[str, tuple]):
        parts: dict[str, dict[int, object]] = {}  # transformers' name -> llama.cpp's tensors that make it
        for t in reader.tensors:
            if t.name not in ROPE_TENSORS:
                parts.setdefault(names.hf_name(t.name), {})[names.half(t.name) or 0] = t
        self._parts = {}
        for name, made in parts.items():
            if len(made) == 2 or names.half(made[next(iter(made))].name) is None:
                self._parts[name] = [made[i] for i in sorted(made)]
            else:  # one of two halves alone: its own name, refused by the family as unexpected
                self._parts |= {t.name: [t] for t in made.values()}
        self._path, self._orders, self._names = path, orders, names

    def __getitem__(self, name: str) -> Tensor:
        halves = [self._read(t) for t in self._parts[name]]
        if len(halves) == 1:
            return halves[0]
        return torch.stack(halves, -1).flatten(-2)  # even entries from the first, odd from the second

    def _read(self, t) -> Tensor:
        raw, order = t.data, next((o for module, o in self._orders.items() if f".{module}." in t.name), None)
        if order is not None:  # rows the converter reordered, read in transformers' order
            rule, heads = order
            raw = raw[rule(raw.shape[0], heads, f"{self._path}: tensor {t.name}")]
        try:
            values = ggml_blocks.dequantize(raw, t.tensor_type)  # a new tensor: the file's map stays read-only
        except Exception as e:  # the errors of a block that does not fit
            raise ValueError(f"{self._path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantised "
                             f"({one_line(e)})") from None
        if self._names.norm_offset and t.name.endswith("norm.weight"):  # stored as offset + w
            values -= self._names.norm_offset
        values = values.reshape(_shape(t))
        return values.transpose(-1, -2) if self._transposed(t) else values

    def _transposed(self, t) -> bool:
        return t.name.split(".", 2)[-1] in self._names.transposed

    def shape(self, name: str) -> tuple[int, ...]:
        t, halves = self._parts[name][0], len(self._parts[name])
        shape = _shape(t)
        if self._transposed(t):
            shape = (*shape[:-2], shape[-1], shape[-2])
        return (*shape[:-1], shape[-1] * halves)

    def gguf_name(self, name: str) -> str:
        return " + ".join(t.name for t in self._parts[name])

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._parts

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def _shape(t) -> tuple[int, ...]:
    """The shape of llama.cpp's tensor ``t`` as torch says it (GGUF lists dims innermost first)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _rope_rows(rows: int, heads: int, where: str):
    """The order to read llama.cpp's q or k rows in to get ``transformers``': per head, llama.cpp
    stores the rows of the two RoPE halves interleaved (row 2i of the first half, 2i+1 of the
    second); ``transformers`` stores the first half, then the second."""
    import numpy as np

    if rows % (2 * heads):
        raise ValueError(f"{where} has {rows} rows, not a multiple of 2 x {heads} heads")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _head_rows(rows: int, heads: int, where: str):
    """The order to read the rows of a fused q, k, v tensor that llama.cpp's converter regroups as q, k, v
    apart (``(3, H, D)``) in to get ``transformers``' per head (``(H, 3, D)``: BLOOM's)."""
    import numpy as np

    if rows % (3 * heads):
        raise ValueError(f"{where} has {rows} rows, not a multiple of 3 x {heads} heads")
    return np.arange(rows).reshape(3, heads, -1).transpose(1, 0, 2).reshape(-1)


def _config(metadata: Metadata, arch: str, names, reader) -> dict:
    """The ``config.json`` dict of ``transformers`` that the file's metadata describes, by the family's
    ``names`` (:class:`selfattn.families._gguf.Names`)."""
    c = {"model_type": names.architectures[arch]}
    for key, (field, kind, default) in names.fields.items():
        c[key] = metadata.value(f"{arch}.{field}", kind, default)
        if kind is int and c[key] is not None and c[key] < 1:  # the counts, sizes and lengths
            raise ValueError(f"{metadata.path}: metadata field {arch}.{field} is {c[key]}, expected at least 1")
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    if c["head_dim"] is None and c["hidden_size"] % c["num_attention_heads"]:
        raise ValueError(f"{metadata.path}: {arch}.embedding_length {c['hidden_size']} is not divisible by "
                         f"{arch}.attention.head_count {c['num_attention_heads']} (and there is no "
                         f"{arch}.attention.key_length to give the head size)")
    tokens = metadata.value("tokenizer.ggml.tokens", list, [])
    stored = {t.name: t for t in reader.tensors}
    rows = int(stored["token_embd.weight"].shape[-1]) if "token_embd.weight" in stored else len(tokens)
    c["vocab_size"] = metadata.value(f"{arch}.vocab_size", int, rows)
    c["tie_word_embeddings"] = "output.weight" not in stored
    for token in ("bos", "eos"):
        c[f"{token}_token_id"] = metadata.value(f"tokenizer.ggml.{token}_token_id", int, None)

    def value(field, kind, default):
        return metadata.value(f"{arch}.{field}", kind, default)

    def factors(name):  # a RoPE factors tensor's values, None when the file has none
        t = stored.get(name)
        return None if t is None else ggml_blocks.dequantize(t.data, t.tensor_type).tolist()

    c |= names.fixed  # what llama.cpp's architecture computes whatever the file says
    try:
        if "rope_theta" in names.fields:
            rope(value, factors, c, c["head_dim"] or c["hidden_size"] // c["num_attention_heads"])
        if names.derive is not None:
            names.derive(arch, value, c)
    except FieldError as e:
        raise ValueError(f"{metadata.path}: {arch}.{e}") from None
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
            """An array of ``length`` strings (a vocabulary, its merges), decoded in one pass over the bytes,
            each a length and its bytes, into ``self.strings[key]``; the reader keeps the array's header
            alone (its own read makes two arrays a string: seconds for a vocabulary of 262k tokens)."""
            data, length_of = memoryview(self.plain), struct.Struct(">Q" if self.byte_order == "S" else "<Q")
            size, strings, offs = len(data), [], orig_offs + 12
            for _ in range(length):
                if offs + 8 > size:
                    raise _Truncated(offs, offs + 8)
                end = offs + 8 + length_of.unpack_from(data, offs)[0]
                if end > size:
                    raise _Truncated(offs + 8, end)
                strings.append(str(data[offs + 8:end], "utf-8", errors="replace"))
                offs = end
            self.strings[self.key] = strings
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            idxs = []
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
    reader.strings = {}  # metadata field -> its array of strings, decoded (see Reader._strings)
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
