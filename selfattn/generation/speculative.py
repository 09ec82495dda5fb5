"""Lossless speculative decoding: a cheap drafter proposes tokens, the model checks them all in
one forward through its KV cache and keeps those it would have produced itself.

Drafters (:class:`Speculative`'s ``method``, :func:`~selfattn.generation.generate`'s ``speculative``):

- ``"lookup"``: prompt lookup (``transformers``' ``prompt_lookup_num_tokens``): the place in the
  prompt and the text generated so far whose last tokens agree longest with the text's last ones
  (a run of at least ``ngram`` tokens) is found; the tokens that followed it are the draft, as
  many as the run is long: a copy that has held for long is likely to hold on (why this draft:
  ``docs/design.md``, "Speculative decoding"). No second model.
- ``"self:N"``: self-speculation (LayerSkip's early exit): the model's first N blocks, then its
  final norm and head. What the draft writes into those blocks' caches is the model's own (the
  same weights on the same tokens), and so is the residual stream it leaves after block N: the
  draft also runs the round's last token through the N blocks, and verification runs only the
  remaining blocks, on those residual streams, filling their caches.
- a draft :class:`~selfattn.model.GPT`: any (smaller) model with the same vocabulary, with a KV
  cache of its own.

One round. The caches are shared by the batch: every row has fed the model the same ``L``
positions, and has committed tokens up to some ``lens_b > L`` (the token after ``L`` is the one
the previous round produced; any later ones were accepted by a row that ran ahead of the
others). The round feeds ``m`` positions ``L .. L + m - 1``: each row's committed tokens
(forced), then its drafts. The model's logits before each draft judge it:

- greedy (temperature 0): a draft stands when it is the model's argmax; the first that does not
  is replaced by the argmax, and when all stand the model's next token follows (the bonus):
  token for token what plain greedy decoding produces (up to rounding: the forward over m
  positions rounds otherwise than one-token steps, which in half precision can turn a near tie
  of two logits the other way; see ``docs/gpt.md``).
- sampling: the speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023): a draft
  ``d`` drawn from the draft's distribution q stands with probability min(1, p(d) / q(d)), p the
  model's; the first rejected one is replaced by a draw from normalised max(0, p - q), and when
  all stand the bonus is drawn from p. p and q both come after the same temperature, top-k and
  top-p (:func:`~selfattn.generation.sampling.probabilities`); prompt lookup's q is a point mass on its
  draft, and a position a row has no draft for has q = 0: a plain draw from p. Every token is
  then distributed as plain sampling draws it.

Row b keeps ``v_b`` of the m fed tokens (its forced ones and the drafts that stood) and commits
one new token after them; every cache is truncated to ``L + min_b v_b``, the positions all rows
agree on (a rolling cache has ``max_k`` extra slots for it, :class:`~selfattn.kv_cache.RollingKVCache`).
A row that kept more has them committed and feeds them again, forced, next round. So each row
accepts its own number of tokens while positions stay contiguous: windows, ALiBi, sink tokens
and left padding behave as in plain decoding. The iterator yields a token for every row as soon
as every row has one, and treats ``eos_token`` as plain decoding does.

The draft length adapts: it grows by 2 (up to ``max_k``) after a round where every draft stood
and shrinks by 1 (down to 1) after one with a rejection; to 1 at once after a round where no
draft stood when each draft cost a forward (early blocks, a draft model). When even a single
draft misses, the next rounds draft nothing (a plain step each, one token through the model) for
1, 4, 16, ... up to ``MAX_PAUSE`` rounds, quadrupling as long as the misses go on, until a round
where every draft stands. Prompt lookup also drafts nothing where no run of ``ngram`` tokens
agrees. So a drafter that keeps missing costs little more than plain decoding (why these steps:
``docs/design.md``, "Speculative decoding").
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn._util import validate as _validate
from selfattn.generation.layout import FEW
from selfattn.generation.sampling import greedy, next_token, probabilities
from selfattn.generation.steps import Steps, decode_cache, steps_of
from selfattn.model import GPT


@dataclass
class SpeculationStats:
    """What speculative runs did, summed over every run of one :class:`Speculative`.

    forwards: the model's forwards (each run's prefill and one per round);
    tokens: tokens yielded, per row;
    drafted, accepted: draft tokens proposed, and those that stood, summed over rows;
    draft_forwards: the drafting model's forwards (0 for prompt lookup).
    """
    forwards: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        """The share of proposed drafts that stood (0.0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens yielded per row per forward of the model: 1.0 is plain decoding's."""
        return self.tokens / self.forwards if self.forwards else 0.0


class Speculative:
    """How :func:`~selfattn.generation.generate` drafts when speculating, and what came of it.

    method: ``"lookup"``, ``"self:N"`` (the first N of the model's blocks draft, 1 <= N < n_layer)
        or a draft GPT with the model's vocabulary, on its device.
    k: the first round's draft length; max_k: the longest it grows to, and the extra slots each
        rolling cache keeps so that rejected drafts can be rolled back. The default 15 makes a
        round at most 16 tokens, the most that ``decode_layout``'s few-row products and the
        compiled graph for several tokens take (``FEW``): a 17-token round takes the form for a
        prompt, and SmolLM2's took markedly longer than its 16-token ones (``docs/benchmarks.md``,
        "Measurements the code cites").
    ngram: the shortest run of agreeing tokens prompt lookup drafts from. 4 rather than 3: 4 was
        the faster on SmolLM2's chat answer, whose short runs seldom go on, and on its edit answer
        (simulated from the measured forward costs; the same section).
    stats: a :class:`SpeculationStats`, added to by every run (read it after the iterator is exhausted).
    """

    def __init__(self, method: str | GPT = "lookup", *, k: int = 4, max_k: int = FEW - 1, ngram: int = 4):
        self.k, self.max_k = _validate.positive_int("k", k), _validate.positive_int("max_k", max_k)
        if max_k < k:
            raise ValueError(f"max_k={max_k} is below k={k}, the first draft length")
        self.ngram = _validate.positive_int("ngram", ngram)
        self.method, self.layers = method, None
        if isinstance(method, str):
            if method.startswith("self:"):
                n = method[len("self:"):]
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"speculative={method!r}: self:N drafts with the model's first N blocks, "
                                     f"N a positive int")
                self.layers = int(n)
            elif method != "lookup":
                raise ValueError(f"speculative must be 'lookup', 'self:N' or a draft GPT, got {method!r}")
        elif not isinstance(method, GPT):
            raise TypeError(f"speculative must be 'lookup', 'self:N', a draft GPT or a Speculative, got "
                            f"{type(method).__name__}")
        self.stats = SpeculationStats()

    def check(self, model: GPT, positions: int) -> None:
        """Refuse what ``model`` cannot speculate with for ``positions`` positions: too many early
        layers, a draft of another vocabulary, on another device or shorter ``block_size``."""
        if self.layers is not None and self.layers >= model.config.n_layer:
            raise ValueError(f"speculative='self:{self.layers}': the drafting blocks must be fewer than the "
                             f"model's n_layer={model.config.n_layer}")
        if isinstance(self.method, GPT):
            draft, device = self.method, model.wte.weight.device
            if draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"the draft model's vocab_size={draft.config.vocab_size} differs from the model's "
                                 f"vocab_size={model.config.vocab_size}: they must share the vocabulary")
            if draft.wte.weight.device != device:
                raise ValueError(f"the draft model is on {draft.wte.weight.device} but the model is on {device}")
            if draft.max_positions is not None and positions > draft.max_positions:
                raise ValueError(f"the draft model reads at most block_size={draft.config.block_size} positions, "
                                 f"this generation needs {positions}")

    def __repr__(self) -> str:
        method = self.method if isinstance(self.method, str) else f"draft {type(self.method).__name__}"
        return f"Speculative({method!r}, k={self.k}, max_k={self.max_k}, ngram={self.ngram})"


def resolve(speculative, model: GPT, positions: int) -> Speculative:
    """``speculative`` as a :class:`Speculative` checked against ``model`` (a new one for a
    string or a draft model, whose statistics then go unread)."""
    spec = speculative if isinstance(speculative, Speculative) else Speculative(speculative)
    spec.check(model, positions)
    return spec


@dataclass
class _Round:
    """What one round feeds at positions ``L .. L + m - 1``: ``tokens`` ``(B, m)``, ``forced``
    ``(B, m)`` where they are committed, ``drafted`` ``(B, m)`` where they are drafts to judge,
    and ``q`` ``(B, m - 1, V)`` the draft distributions of positions ``L + 1 ..`` (None: point
    masses on the drafts, or greedy)."""
    L: int
    tokens: Tensor
    forced: Tensor
    drafted: Tensor
    q: Tensor | None = None

    @property
    def m(self) -> int:
        return self.tokens.shape[1]



def _mask(mask: Tensor | None, S: int) -> Tensor | None:
    return None if mask is None else mask[:, :S]


def _committed(seq: Tensor, lens: Tensor, L: int, m: int) -> tuple[Tensor, Tensor]:
    """The tokens at ``L .. L + m - 1`` ``(B, m)`` (what is past a row's committed ones is to be
    drafted) and where they are committed ``(B, m)``."""
    forced = torch.arange(m, device=seq.device) < (lens - L)[:, None]  # (B, m)
    return seq[:, L:L + m].clone(), forced


def _draw(logits: Tensor, sample: dict) -> tuple[Tensor, Tensor | None]:
    """A draft token per row of ``logits`` ``(B, V)`` and the distribution it was drawn from
    (None when greedy, where only the argmax matters)."""
    if sample["temperature"] == 0:
        return greedy(logits), None
    q = probabilities(logits, temperature=sample["temperature"], top_k=sample["top_k"], top_p=sample["top_p"])
    return torch.multinomial(q, 1, generator=sample["generator"]).squeeze(-1), q  # (B,), (B, V)


class _Drafter:
    """What every drafter does: ``draft`` a round, have the model ``verify`` it in one forward
    (logits ``(B, m, V)``), ``truncate`` whatever cache of its own to the kept positions. A
    round that feeds one token (nothing drafted) is a plain decode step, compiled as plain
    decoding's when the model is (:func:`~selfattn.generation.compile_decode`).
    ``forwards_per_draft``: whether each drafted token costs a forward (of a draft model or of
    early blocks); after a round where none stood, such a drafter drafts one token, not one fewer."""
    forwards_per_draft = True

    def __init__(self, model: GPT):
        steps = steps_of(model)  # compiled after compile_decode(model)
        self.model, self.hidden, self.logits, self.step = model, steps.hidden, steps.logits, steps.step

    def verify(self, rnd: _Round, cache, mask) -> Tensor:
        if rnd.m == 1:
            return self.step(rnd.tokens, _mask(mask, rnd.L + 1), cache, rnd.L)[:, None]  # (B, 1, V)
        return self.logits(rnd.tokens, _mask(mask, rnd.L + rnd.m), cache, rnd.L)  # (B, m, V)

    def truncate(self, length: int) -> None:
        pass


class _Lookup(_Drafter):
    """Prompt lookup: each row's drafts copy what followed the earlier place among its real
    tokens whose last ones agree longest with the row's last ones. A copy that has held for
    ``run`` tokens is drafted for as many more (and up to the round's length); a run shorter
    than ``ngram`` drafts nothing."""
    forwards_per_draft = False

    def __init__(self, model: GPT, ngram: int, reach: int):
        super().__init__(model)
        self.ngram, self.reach = ngram, max(ngram, reach)  # runs are counted up to `reach` tokens

    def draft(self, seq: Tensor, lens: Tensor, L: int, m: int, start: Tensor, mask, sample) -> _Round:
        tokens, forced = _committed(seq, lens, L, m)
        B, N = seq.shape
        device = seq.device
        back = torch.arange(self.reach, device=device)  # (J,) tokens back from the last one
        s = torch.arange(N, device=device)[:, None]  # (N, 1) where an earlier copy's last token is
        theirs = s - back  # (N, J)
        mine = lens[:, None] - 1 - back  # (B, J)
        agree = seq.gather(1, theirs.clamp(min=0).view(1, -1).expand(B, -1)).view(B, N, -1) == \
            seq.gather(1, mine.clamp(min=0))[:, None]  # (B, N, J)
        agree &= (theirs >= start[:, None, None]) & (mine >= start[:, None])[:, None]  # real tokens only
        agree &= (s < lens[:, None, None] - 1)  # an earlier place, with a token after it to copy
        runs = agree.int().cumprod(dim=-1).sum(dim=-1)  # (B, N) tokens each place agrees for
        run, last = runs.max(dim=1)  # (B,) the longest, and its first place
        source = last + 1  # where each row's copy starts
        count = torch.minimum(torch.minimum(run, lens - source), L + m - lens)  # (B,) drafts per row
        count = torch.where(run >= self.ngram, count, 0)
        offset = torch.arange(m, device=device) - (lens - L)[:, None]  # (B, m) place in the row's draft
        drafted = (offset >= 0) & (offset < count[:, None])
        copied = seq.gather(1, (source[:, None] + offset).clamp(0, N - 1))  # (B, m)
        tokens = torch.where(drafted, copied, tokens)
        m = int(torch.where(count > 0, lens - L + count, 1).max())  # no longer than the longest draft needs
        return _Round(L, tokens[:, :m], forced[:, :m], drafted[:, :m])


class _DraftModel(_Drafter):
    """A draft GPT with a cache of its own, ``length`` positions of which are fed; a round first
    feeds what it has not read of the committed tokens, then drafts one token per step."""

    def __init__(self, model: GPT, draft: GPT, batch_size: int, positions: int, rollback: int,
                 stats: SpeculationStats):
        super().__init__(model)
        self.draft_model, self.draft_hidden, self.stats, self.length = draft, steps_of(draft).hidden, stats, 0
        self.draft_cache = decode_cache(draft, batch_size, positions, rollback=rollback)

    def draft(self, seq: Tensor, lens: Tensor, L: int, m: int, start: Tensor, mask, sample) -> _Round:
        tokens, forced = _committed(seq, lens, L, m)
        d, qs = self.draft_model, []
        if m > 1:
            fresh = torch.cat([seq[:, self.length:L], tokens[:, :1]], dim=1)  # (B, L + 1 - length) all committed
            h = self.draft_hidden(fresh, _mask(mask, L + 1), self.draft_cache, self.length)[:, -1]  # (B, C)
            for j in range(1, m):
                tok, q = _draw(d.logits(h), sample)
                tokens[:, j] = torch.where(forced[:, j], tokens[:, j], tok)
                qs.append(q)
                if j + 1 < m:
                    h = self.draft_hidden(tokens[:, j:j + 1], _mask(mask, L + j + 1), self.draft_cache, L + j)[:, -1]
            self.length = L + m - 1
            self.stats.draft_forwards += m - 1
        q = torch.stack(qs, dim=1) if qs and qs[0] is not None else None  # (B, m - 1, V)
        return _Round(L, tokens, forced, ~forced, q)

    def truncate(self, length: int) -> None:
        if length < self.length:
            for layer in self.draft_cache:
                layer.truncate(length)
            self.length = length


class _EarlyExit(_Drafter):
    """Self-speculation: the model's first ``layers`` blocks, ``ln_f`` and head draft, through
    the model's own caches of those blocks; their residual streams feed verification."""

    def __init__(self, model: GPT, layers: int, cache, stats: SpeculationStats):
        super().__init__(model)
        self.layers, self.cache, self.stats, self.h = layers, cache, stats, None

    def draft(self, seq: Tensor, lens: Tensor, L: int, m: int, start: Tensor, mask, sample) -> _Round:
        tokens, forced = _committed(seq, lens, L, m)
        if m == 1:  # nothing to draft: verification is a plain step
            return _Round(L, tokens, forced, ~forced)
        model, hs, qs = self.model, [], []
        for j in range(m):  # every fed token, the last too: verification continues from its stream
            h = self.hidden(tokens[:, j:j + 1], _mask(mask, L + j + 1), self.cache, L + j, stop=self.layers)
            hs.append(h)  # (B, 1, C) the residual stream entering block `layers`
            if j + 1 < m:
                tok, q = _draw(model.logits(model.ln_f(h[:, 0])), sample)
                tokens[:, j + 1] = torch.where(forced[:, j + 1], tokens[:, j + 1], tok)
                qs.append(q)
        self.h = torch.cat(hs, dim=1)  # (B, m, C)
        self.stats.draft_forwards += m
        q = torch.stack(qs, dim=1) if qs and qs[0] is not None else None  # (B, m - 1, V)
        return _Round(L, tokens, forced, ~forced, q)

    def verify(self, rnd: _Round, cache, mask) -> Tensor:
        if rnd.m == 1:
            return super().verify(rnd, cache, mask)
        h = self.hidden(None, _mask(mask, rnd.L + rnd.m), cache, rnd.L, start=self.layers, x=self.h)  # (B, m, C)
        return self.model.logits(h)


def _verdicts(p_draft: Tensor, q_draft: Tensor, sample: dict) -> Tensor:
    """Whether each draft stands: ``p_draft`` and ``q_draft`` are the model's and the draft's
    probabilities of the drafted tokens (any shape, q > 0). Sampling, with probability
    min(1, p(d) / q(d)), the speculative sampling rule; greedy, where ``p_draft`` is 1 on the
    model's argmax and 0 elsewhere, when it is the argmax."""
    if sample["temperature"] == 0:
        return p_draft > 0
    u = torch.rand(p_draft.shape, generator=sample["generator"], device=p_draft.device)
    return u * q_draft < p_draft


def _judge(logits: Tensor, rnd: _Round, sample: dict) -> tuple[Tensor, Tensor, Tensor]:
    """The model's verdict on a round from its logits ``(B, m, V)``: per row the number ``v`` of
    fed tokens it keeps (forced ones and the drafts that stood, >= 1), the new token at position
    ``L + v``, and which drafts stood ``(B, m - 1)``."""
    B, m, _ = logits.shape
    rows = torch.arange(B, device=logits.device)
    draft, drafted = rnd.tokens[:, 1:], rnd.drafted[:, 1:]  # (B, m - 1) positions L + 1 .. L + m - 1
    argmax = sample["temperature"] == 0
    if argmax:
        p = None
        p_draft = (draft == greedy(logits[:, :-1])).float()  # (B, m - 1)
    else:
        p = probabilities(logits, temperature=sample["temperature"], top_k=sample["top_k"],
                          top_p=sample["top_p"])  # (B, m, V)
        p_draft = p[:, :-1].gather(-1, draft[..., None])[..., 0]  # (B, m - 1)
    q_draft = torch.ones_like(p_draft) if rnd.q is None else rnd.q.gather(-1, draft[..., None])[..., 0]
    stands = drafted & _verdicts(p_draft, q_draft, sample)
    kept = (stands | rnd.forced[:, 1:]).int().cumprod(dim=1)  # (B, m - 1) 1 up to the first rejection
    v = 1 + kept.sum(dim=1)  # (B,) fed tokens kept
    if argmax:
        return v, greedy(logits[rows, v - 1]), stands & kept.bool()
    p_new = p[rows, v - 1]  # (B, V) the model's distribution at position L + v
    if m > 1:  # where a draft was rejected there, draw from max(0, p - q) instead
        at = (v - 1).clamp(max=m - 2)  # (B,) the first draft that did not stand, where one did not
        rejected = (v < m) & drafted[rows, at]  # (B,)
        if rnd.q is None:
            q_new = nn.functional.one_hot(draft[rows, at], p.shape[-1]).to(p.dtype)  # (B, V) a point mass
        else:
            q_new = rnd.q[rows, at]  # (B, V)
        residual = (p_new - q_new).clamp(min=0)
        total = residual.sum(dim=-1, keepdim=True)  # (B, 1) > 0 where rejected, but for rounding
        p_new = torch.where(rejected[:, None] & (total > 0), residual / total.clamp(min=1e-30), p_new)
    new = torch.multinomial(p_new, 1, generator=sample["generator"]).squeeze(-1)  # (B,)
    return v, new, stands & kept.bool()


MAX_PAUSE = 256  # the most plain rounds between two tries of a drafter that keeps missing


def _finish(seq: Tensor, lens: Tensor, T: int, eos_token: int) -> None:
    """A row that committed ``eos_token`` has it to the end, all of it committed (in place)."""
    new = seq[:, T:]  # (B, max_new) a view
    hit = (new == eos_token) & (torch.arange(new.shape[1], device=seq.device) < (lens - T)[:, None])
    first = torch.where(hit.any(dim=1), hit.int().argmax(dim=1), new.shape[1])  # (B,)
    new.masked_fill_(torch.arange(new.shape[1], device=seq.device) > first[:, None], eos_token)
    lens.masked_fill_(hit.any(dim=1), seq.shape[1])


@torch.inference_mode()
def decode(model: GPT, spec: Speculative, idx: Tensor, max_new_tokens: int, mask: Tensor | None,
           eos_token: int | None, sample: dict) -> Iterator[Tensor]:
    """:func:`~selfattn.generation.generate`'s loop when speculating, over validated arguments
    (``mask`` ``(B, S_max)`` or None; ``sample`` the sampling keywords of ``next_token``)."""
    if max_new_tokens == 0:
        return
    B, T = idx.shape
    end, device, stats = T + max_new_tokens, idx.device, spec.stats
    cache = decode_cache(model, B, end - 1, rollback=spec.max_k)  # the last new token is never fed
    if spec.layers is not None:
        drafter = _EarlyExit(model, spec.layers, cache, stats)
    elif isinstance(spec.method, str):
        drafter = _Lookup(model, spec.ngram, spec.max_k)
    else:
        drafter = _DraftModel(model, spec.method, B, end - 1, spec.max_k, stats)
    seq = torch.zeros(B, end, dtype=torch.long, device=device)  # (B, T + max_new) prompts and committed tokens
    seq[:, :T] = idx
    lens = torch.full((B,), T + 1, dtype=torch.long, device=device)  # (B,) committed tokens per row
    start = torch.zeros(B, dtype=torch.long, device=device) if mask is None else T - mask[:, :T].sum(dim=1)
    seq[:, T] = next_token(Steps(model).step(idx, _mask(mask, T), cache, 0), **sample)  # the prefill, eager
    stats.forwards += 1
    finished = None if eos_token is None else torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    L, k, yielded = T, spec.k, 0
    pause, backoff = 0, 1  # rounds left without drafting, and the next pause's length
    while True:
        if eos_token is not None:
            _finish(seq, lens, T, eos_token)
        while yielded < int(lens.min()) - T:
            tok = seq[:, T + yielded].clone()  # (B,)
            if finished is not None:
                tok = tok.masked_fill(finished, eos_token)
                finished |= tok == eos_token
            yielded += 1
            stats.tokens += 1
            yield tok
            if yielded == max_new_tokens or (finished is not None and bool(finished.all())):
                return
        rnd = drafter.draft(seq, lens, L, 1 if pause else min(k + 1, end - 1 - L), start, mask, sample)
        pause = max(0, pause - 1)
        logits = drafter.verify(rnd, cache, mask)  # (B, m, V)
        stats.forwards += 1
        if rnd.m == 1:  # nothing drafted: a plain step, the next token of every row that lacks one
            seq[:, L + 1] = torch.where(lens > L + 1, seq[:, L + 1], next_token(logits[:, 0], **sample))
            lens, L = lens.clamp(min=L + 2), L + 1  # the caches hold L + 1 positions: nothing to truncate
            continue
        v, new, stood = _judge(logits, rnd, sample)
        m, rows = rnd.m, torch.arange(B, device=device)
        keep = torch.arange(m, device=device) < v[:, None]  # (B, m) the fed tokens each row keeps
        seq[:, L:L + m] = torch.where(keep & ~rnd.forced, rnd.tokens, seq[:, L:L + m])
        fresh = L + v >= lens  # (B,) rows whose token at L + v is new (not one they committed before)
        seq[rows[fresh], (L + v)[fresh]] = new[fresh]
        lens = torch.maximum(lens, L + v + 1)
        drafted, accepted = int(rnd.drafted[:, 1:].sum()), int(stood.sum())
        stats.drafted, stats.accepted = stats.drafted + drafted, stats.accepted + accepted
        if drafted and accepted == drafted:
            k, backoff = min(spec.max_k, k + 2), 1
        elif drafted and accepted == 0 and k == 1:  # a single draft missed: plain steps for a while
            pause, backoff = backoff, min(4 * backoff, MAX_PAUSE)
        elif drafted and accepted == 0 and drafter.forwards_per_draft:  # drafts that cost forwards: one next
            k = 1
        elif drafted:
            k = max(1, k - 1)
        L += int(v.min())
        for layer in cache:
            layer.truncate(L)
        drafter.truncate(L)
