"""Chat data for fine-tuning: conversations in, token rows whose targets are the assistant's tokens only.

The file: JSON Lines, one conversation a line, ``{"messages": [{"role": ..., "content": ...}, ...]}``
(OpenAI's and TRL's format), a content a string or a list of text parts (``[{"type": "text",
"text": ...}]``), a role one the model's chat template writes (system, user, assistant, and tool
where the template names it: ``ChatTemplate.roles``). ``--data`` is chat data exactly when its name ends in ``.jsonl``
(:func:`is_chat_data`): the suffix decides, the content is never sniffed, so a text corpus that
happens to hold JSON stays text. Blank lines are skipped; other keys of a line or of a message are
kept (a message's reach the template). The file follows :func:`selfattn.training.data.read_corpus`'s
rules (UTF-8, no NUL byte, at most ``MAX_CORPUS_BYTES``) and must be one file, not a folder.

Encoding (:func:`encode`): the conversation is rendered with the model's chat template
(``add_generation_prompt=False``) and tokenized whole, without adding special tokens, exactly as
``transformers``' ``apply_chat_template(tokenize=True)`` does: a template that writes the bos
(SmolLM2's ``<|im_start|>``, Llama 3's ``<|begin_of_text|>``) gets it once; a template that writes
none gets none. The assistant's turns are found whatever the template: the span of assistant
message ``i`` is the text between the render of ``messages[:i]`` with the generation prompt and the
render of ``messages[:i+1]`` without it, that is the assistant's content and what the template
writes after it (SmolLM2: ``content + "<|im_end|>\\n"``), never the text that opens the turn
(``<|im_start|>assistant\\n``). A template for which these renders are not prefixes of one another
(one that rewrites earlier turns) is refused, naming it. A token is in the mask when any of its
characters is in a span (as ``transformers``' ``return_assistant_tokens_mask`` counts it).

Targets: ``targets[t] = ids[t + 1] if mask[t + 1] else -100``: position t learns the next token
when that token is the assistant's, so the model learns the answers and to end them, never the
prompts. A conversation longer than ``block_size`` tokens is refused, not truncated: truncation
would silently cut answers.

Rows (:func:`rows`): one conversation a row, padded on the right; or ``pack``: conversations laid
greedily one after another in rows of ``block_size``, each its own document (``doc_ids``, a new id
at each conversation, the padding at a row's end one more), for ``model(x, y, doc_ids=doc_ids)``:
positions restart and attention stops at each document, and a document's last token has no target.

:func:`prepare_chat` tokenizes a file once into a cache (:func:`selfattn.training.data.write_cache`)
and returns a :class:`ChatCorpus`, which batches as a text corpus does (see
:mod:`selfattn.training.data`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from selfattn._util import progress
from selfattn._util.seeds import seed_for
from selfattn._util.validate import short_json
from selfattn.loss import IGNORE
from selfattn.tokenizers import BPETokenizer
from selfattn.tokenizers.chat import ChatTemplate, text_messages
from selfattn.training import data as text_data

SUFFIX = ".jsonl"  # the file name ending that makes --data chat data
PAD = 0  # the id padding positions hold: never a target, never attended to by a real token


def is_chat_data(path: str | os.PathLike | None) -> bool:
    """Whether ``--data path`` is chat data: its name ends in ``.jsonl`` (any case)."""
    return path is not None and Path(path).suffix.lower() == SUFFIX


@dataclass(frozen=True)
class Conversation:
    """One line of a chat file."""
    line: int  # 1-based, in the file
    messages: list[dict]  # each with a str "role" and a str "content"


@dataclass(frozen=True)
class Encoded:
    """A conversation as tokens: ``ids`` and ``mask`` (True on the assistant's tokens), equally long."""
    line: int
    ids: list[int]
    mask: list[bool]

    def targets(self) -> list[int]:
        """``targets[t] = ids[t + 1] if mask[t + 1] else -100``; the last token has none."""
        return [i if m else IGNORE for i, m in zip(self.ids[1:], self.mask[1:])] + [IGNORE]


class Rows(NamedTuple):
    """Rows of one split: inputs, targets (-100: none) and, packed, document ids, each ``(R, T)``."""
    x: Tensor
    y: Tensor
    doc_ids: Tensor | None  # None: one conversation a row


def read_conversations(path: str | os.PathLike) -> list[Conversation]:
    """The conversations of the chat file ``path`` (see the module docstring for its format).

    Raises ``ValueError`` naming the file, and the line (1-based) for a line that is not JSON, not an
    object with ``messages``, whose messages are not a non-empty list of ``{"role": str, "content":
    str or text parts}``, or that has no assistant message (it would teach nothing). A role the
    template does not write is refused when the conversations are encoded (:func:`encode_all`)."""
    return _parse(_read(path), str(path))


def encode(messages: list[dict], tokenizer: BPETokenizer, template: ChatTemplate) -> tuple[list[int], list[bool]]:
    """The token ids of ``messages`` rendered by ``template`` and the mask of the assistant's tokens
    (see the module docstring). Raises ``ValueError`` naming the template when its renders of the
    conversation's beginnings are not prefixes of one another, or when it refuses the conversation."""
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"chat data needs the model's BPETokenizer (its character offsets), got "
                        f"{type(tokenizer).__name__}")
    text = template.render(messages, add_generation_prompt=False)
    in_span = bytearray(len(text) + 1)  # in_span[c] = 1: character c is the assistant's
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[:i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(f"{template.where}: the chat template does not write a conversation turn by turn: its "
                             f"text of the {i} message(s) before message {i + 1} (the assistant's) with the generation "
                             f"prompt is not a prefix of its text through message {i + 1}, or that not a prefix of the "
                             f"whole conversation's (does it rewrite earlier turns?), so the assistant's tokens cannot "
                             f"be told apart")
        in_span[len(before):len(through)] = b"\x01" * (len(through) - len(before))
    encoding = tokenizer.tok.encode(text, add_special_tokens=False)
    mask = [any(in_span[start:max(end, start + 1)]) for start, end in encoding.offsets]
    return encoding.ids, mask


def encode_all(conversations: Sequence[Conversation], tokenizer: BPETokenizer, template: ChatTemplate, *,
               where: str, block_size: int) -> list[Encoded]:
    """:func:`encode` of every conversation of the file ``where``; a ``ValueError`` naming the file and
    line of one longer than ``block_size`` tokens (refused, not truncated), one without a token to
    predict (empty answers the template writes nothing around: it would teach nothing, and a batch of
    such rows would have a NaN loss) or one the template refuses."""
    encoded = []
    for conversation in progress.track(conversations, f"tokenizing {Path(where).name}", total=len(conversations),
                                       unit="conversation"):
        try:
            ids, mask = encode(conversation.messages, tokenizer, template)
        except ValueError as e:
            raise ValueError(f"{where} line {conversation.line}: {e}") from None
        if len(ids) > block_size:
            raise ValueError(f"{where} line {conversation.line}: the conversation is {len(ids)} tokens, longer than "
                             f"block_size {block_size}; it is refused, not truncated (that would cut answers): "
                             f"shorten it, drop it or raise the block size")
        if not any(mask[1:]):
            raise ValueError(f"{where} line {conversation.line}: the assistant's turns hold no token to predict "
                             f"(empty answers?), so the conversation would teach nothing")
        encoded.append(Encoded(conversation.line, ids, mask))
    return encoded


def rows(encoded: Sequence[Encoded], block_size: int, *, pack: bool) -> Rows:
    """The rows of ``block_size`` tokens of conversations no longer than that: one a row, padded on
    the right with :data:`PAD` (targets -100), ``doc_ids`` None; or ``pack``: laid in order, a new
    row whenever the next one does not fit, each a document (ids 0, 1, ... along a row, the padding
    the last), targets -100 on padding and at each document's last token."""
    groups, fill = [], block_size  # fill: the tokens of the last row
    for e in encoded:
        assert len(e.ids) <= block_size, "encode_all refuses conversations longer than a row"
        if pack and fill + len(e.ids) <= block_size:
            groups[-1].append(e)
            fill += len(e.ids)
        else:
            groups.append([e])
            fill = len(e.ids)
    x = torch.full((len(groups), block_size), PAD, dtype=torch.int32)  # (R, T)
    y = torch.full((len(groups), block_size), IGNORE, dtype=torch.int32)  # (R, T)
    doc_ids = torch.empty((len(groups), block_size), dtype=torch.int32)  # (R, T)
    for r, group in enumerate(groups):
        start = 0
        for d, e in enumerate(group):
            end = start + len(e.ids)
            x[r, start:end], y[r, start:end], doc_ids[r, start:end] = torch.tensor(e.ids), torch.tensor(e.targets()), d
            start = end
        doc_ids[r, start:] = len(group)  # the padding, a document of its own
    return Rows(x, y, doc_ids if pack else None)


@dataclass
class ChatCorpus:
    """Train and val rows (memory-mapped) of a chat file, with the interface of
    :class:`selfattn.training.data.Corpus`."""
    train: Rows
    val: Rows
    tokenizer: BPETokenizer
    description: str  # the file and its conversations, for people
    fingerprint: str  # SHA-256 of the file's text: a resumed run checks it still trains on the same data
    block_size: int  # T of every row
    n_train: int  # the tokens of the train conversations (padding not counted)
    n_val: int

    def batch(self, split: str, *, seed: int, step: int, batch_size: int, part: int = 0,
              parts: int = 1) -> tuple[Tensor, Tensor, Tensor | None]:
        """Part ``part`` of ``parts`` equal slices of the ``batch_size`` rows of step ``step`` of
        split ``split`` (``"train"`` or ``"val"``): ``(x, y, doc_ids)``, each ``(batch_size // parts,
        block_size)`` int64, ``doc_ids`` None when unpacked.

        The rows depend only on (seed, split, step): the split's rows are read in epochs, each
        epoch in its own random order, the n-th batch taking rows ``n * batch_size`` to ``(n + 1) *
        batch_size - 1`` of that endless sequence, so every row is read once an epoch, a resumed run
        reads what it would have read, and ranks and micro-steps read disjoint slices of one batch.
        Steps are counted as the training loop counts them: training's from 1 (step s is the
        ``s - 1``-th batch), evaluation's from 0."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        first = 1 if split == "train" else 0
        if not (isinstance(step, int) and step >= first):
            raise ValueError(f"{split} steps count from {first}, got step={step!r}")
        data = getattr(self, split)
        mine = _epoch_rows(len(data.x), seed, split, step - first, batch_size)[text_data.part_of(batch_size, part,
                                                                                                  parts)]
        return (data.x[mine].long(), data.y[mine].long(),  # (rows, T), (rows, T)
                None if data.doc_ids is None else data.doc_ids[mine].long())


def prepare_chat(cache_dir: str | os.PathLike, *, data: str | os.PathLike, tokenizer: BPETokenizer,
                 template: ChatTemplate, block_size: int, val_fraction: float, pack: bool,
                 trained_on: str | None = None) -> ChatCorpus:
    """Encode the chat file ``data`` into rows in ``cache_dir`` (once: a cache whose recipe, file
    fingerprint, tokenizer, template, ``block_size``, ``pack`` and ``val_fraction`` included, matches
    is reused) and open them memory-mapped. Val is the last ``val_fraction`` of the conversations
    (``int(n * val_fraction)``). Raises ``ValueError``, before anything is written, for a bad file or
    conversation (naming the line), a split without a conversation, or a file that is not the one of
    fingerprint ``trained_on``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    text = _read(data)
    fingerprint = text_data.check_fingerprint(text, str(data), trained_on)
    cache = Path(cache_dir)
    recipe = {"kind": "chat", "fingerprint": fingerprint, "tokenizer": text_data.spec_digest(tokenizer.spec()),
              "template": text_data.spec_digest([template.source, template.tokens]), "block_size": block_size,
              "pack": pack, "val_fraction": val_fraction}
    meta = text_data.read_cache(cache, recipe)
    if meta is None:
        with progress.stage(f"reading {Path(data).name}"):
            conversations = _parse(text, str(data))
        n_val = int(len(conversations) * val_fraction)
        if not 0 < n_val < len(conversations):
            raise ValueError(f"{data}: {len(conversations)} conversation(s) with val_fraction {val_fraction} leave "
                             f"{len(conversations) - n_val} for train and {n_val} for val; each split needs at least "
                             f"one: add conversations or change val_fraction")
        encoded = encode_all(conversations, tokenizer, template, where=str(data), block_size=block_size)
        splits = {"train": encoded[:len(encoded) - n_val], "val": encoded[len(encoded) - n_val:]}
        arrays = {}
        with progress.stage("writing the token cache"):
            for name, part in splits.items():
                x, y, doc_ids = rows(part, block_size, pack=pack)
                arrays |= {f"{name}.x": x.to(text_data.id_dtype(tokenizer.vocab_size)), f"{name}.y": y}
                if doc_ids is not None:
                    arrays[f"{name}.doc_ids"] = doc_ids.to(text_data.id_dtype(block_size + 1))
            counts = {f"n_{name}": sum(len(e.ids) for e in part) for name, part in splits.items()}
            meta = text_data.write_cache(cache, arrays, {"recipe": recipe, "conversations": len(encoded), **counts})
    arrays = text_data.open_arrays(cache, meta)
    train, val = (Rows(arrays[f"{name}.x"], arrays[f"{name}.y"], arrays.get(f"{name}.doc_ids"))
                  for name in ("train", "val"))
    description = (f"{data} ({meta['conversations']} conversations in {len(train.x)} train / {len(val.x)} val rows "
                   f"of {block_size} tokens, {'packed' if pack else 'one a row'})")
    return ChatCorpus(train, val, tokenizer, description, fingerprint, block_size, meta["n_train"], meta["n_val"])


def _read(path: str | os.PathLike) -> str:
    """The text of the chat file ``path`` by the rules of :func:`~selfattn.training.data.read_corpus`; not a folder."""
    if Path(path).is_dir():
        raise ValueError(f"chat data {str(path)!r} is a folder; give one {SUFFIX} file")
    return text_data.read_corpus(path)[0]


def _parse(text: str, where: str) -> list[Conversation]:
    """The conversations of the JSON Lines ``text`` of the file ``where`` (not blank: read_corpus refuses that)."""
    conversations = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {number}: not JSON ({e.msg} at column {e.colno})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where} line {number}: expected an object with a non-empty list \"messages\", got "
                             f"{short_json(record)}")
        try:
            messages = text_messages(messages)
        except ValueError as e:
            raise ValueError(f"{where} line {number}: {e}") from None
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where} line {number}: the conversation has no assistant message, so it would teach "
                             f"nothing (roles: {', '.join(m['role'] for m in messages)})")
        conversations.append(Conversation(number, messages))
    return conversations


def _epoch_rows(n_rows: int, seed: int, tag: str, step: int, batch_size: int) -> Tensor:
    """Rows ``step * batch_size`` to ``(step + 1) * batch_size - 1`` of the sequence of epochs of
    ``n_rows`` rows, each epoch a random order named by (seed, tag, epoch): ``(batch_size,)`` int64."""
    index = torch.arange(step * batch_size, (step + 1) * batch_size)  # (batch_size,)
    epochs = index // n_rows
    return torch.cat([_order(n_rows, seed, tag, e)[index[epochs == e] % n_rows] for e in epochs.unique().tolist()])


@lru_cache(maxsize=4)
def _order(n_rows: int, seed: int, tag: str, epoch: int) -> Tensor:
    """The order in which epoch ``epoch`` reads the ``n_rows`` rows: ``(n_rows,)`` int64."""
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed_for(seed, tag, "epoch", epoch)))
