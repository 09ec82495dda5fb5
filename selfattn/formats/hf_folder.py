"""A folder written by ``transformers``' ``save_pretrained``, read without ``transformers``.

- ``config.json``: the model's config (:func:`config`);
- ``model.safetensors``, or the shards ``model.safetensors.index.json`` names: the weights, read
  tensor by tensor (:class:`Safetensors`); a folder holding only a pickle is refused with how to
  convert it, never unpickled;
- ``tokenizer.json``: any tokenizer :class:`~selfattn.tokenizers.BPETokenizer` streams (byte-level
  BPE, SentencePiece-style BPE), else none (:func:`tokenizer`);
- special tokens: the bos of ``config.json``, the eos (one or several) of ``generation_config.json``
  or else ``config.json`` (:func:`special_ids`);
- the chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``,
  with the special tokens ``tokenizer_config.json`` names (:func:`chat_template`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from torch import Tensor

from selfattn._util.jsonfile import json_object, text
from selfattn._util.validate import one_line
from selfattn.tokenizers.bpe import BPETokenizer, read, scheme
from selfattn.tokenizers.chat import ChatTemplate

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")  # the tokens a chat template may name


def config(folder: Path) -> dict:
    return json_object(folder / "config.json")


class Safetensors(Mapping):
    """The tensors of a folder's ``model.safetensors`` (or of the shards its index names), each
    read from its file when looked up; ``shape(name)`` reads only the header."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        names = sorted(set(json_object(index).get("weight_map", {}).values())) if index.is_file() \
            else ["model.safetensors"]
        absent = [name for name in names if not (folder / name).is_file()]
        if absent:
            pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
            hint = (f": it holds its weights as a pickle ({pickles[0]}), which is never loaded. Convert it once, "
                    f"where you trust the file: AutoModelForCausalLM.from_pretrained('{folder}')"
                    f".save_pretrained('{folder}') writes model.safetensors") if pickles else ""
            raise ValueError(f"{folder} has no {', '.join(absent)}{hint}")
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("reading a transformers folder needs 'safetensors': pip install 'selfattn[train]'") from e
        self._files, self._file_of = {}, {}
        for name in names:
            try:
                self._files[name] = safe_open(str(folder / name), framework="pt")
            except Exception as e:  # the Rust reader raises its own types for malformed files
                raise ValueError(f"{folder / name} cannot be read as safetensors ({one_line(e)})") from None
            self._file_of |= dict.fromkeys(self._files[name].keys(), name)

    def __getitem__(self, name: str) -> Tensor:
        return self._files[self._file_of[name]].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._file_of[name]].get_slice(name).get_shape())

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def tokenizer(folder: Path) -> BPETokenizer | None:
    """The folder's ``tokenizer.json`` when it is one :class:`BPETokenizer` streams; None without
    one or for another kind (WordPiece, say); a ValueError naming the file when it is unreadable
    (not UTF-8, as the ``tokenizers`` library refuses it too, or not a tokenizer)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    tok = read(file)
    return BPETokenizer(tok, str(file)) if scheme(tok) else None


def special_ids(folder: Path, hf: dict, vocab_size: int) -> tuple[int | None, tuple[int, ...]]:
    """(bos id or None, the eos ids generation stops at) of the folder: ``generation_config.json``
    first, then ``config.json``; ids outside the vocabulary are left out."""
    generation = folder / "generation_config.json"
    sources = [json_object(generation)] if generation.is_file() else []
    sources.append(hf)

    def ids(key: str) -> list[int]:
        for source in sources:
            value = source.get(key)
            values = value if isinstance(value, list) else [value]
            found = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size]
            if found:
                return found
        return []

    bos = ids("bos_token_id")
    return (bos[0] if bos else None), tuple(ids("eos_token_id"))


def chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``: a string, or the one named "default" of a list), or None."""
    config_file = folder / "tokenizer_config.json"
    config = json_object(config_file) if config_file.is_file() else {}
    tokens = {name: _content(config.get(name)) for name in SPECIAL if _content(config.get(name)) is not None}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(text(jinja), tokens, str(jinja))
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return None if source is None else ChatTemplate(source, tokens, f"{config_file} (chat_template)")


def _content(token) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken's ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None
