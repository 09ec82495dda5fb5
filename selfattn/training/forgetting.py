"""What a fine-tune may cost the model: its loss on general text, and the best checkpoint by val loss.

A fine-tune on a narrow set (twenty chats of one fact) can learn it and wreck what the model knew.
The task's own val loss says so late and only about the task; so a run started from a model
(``--init-from``) also measures, at every evaluation, the model's loss on a *general* text it was not
trained on (:func:`general_rows`: the first ``general_tokens`` tokens of ``general_data``, by default
the built-in corpus), beside the task's, and :class:`Watch` turns the evaluations into warnings (each
once a run) by two rules:

- the general loss more than :data:`GENERAL_RISE` nats above the model's own before training (a
  perplexity more than about 10 % higher): the model is forgetting;
- the val loss above its best for :data:`RISING` evaluations in a row: the run is past its best
  (over-fitting), and the best checkpoint, kept apart (``best.safetensors``), is the one to use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from selfattn.training.data import read_corpus

GENERAL_RISE = 0.1  # nats per token of general loss above the start: a perplexity ~10.5 % higher
RISING = 2  # evaluations in a row with the val loss above its best


def general_rows(tokenizer, data: str | None, tokens: int, seq_len: int) -> Tensor:
    """The general text ``data`` (a file or folder; None: the built-in corpus) as rows of ``seq_len``
    + 1 tokens, the first ``tokens`` tokens of it (at least one row): ``(R, seq_len + 1)`` int64.
    A ValueError naming the text when it holds fewer than ``seq_len + 1`` tokens."""
    text, description = read_corpus(data)
    per_row = seq_len + 1
    rows = max(1, tokens // seq_len)
    ids = tokenizer.encode(text[:rows * per_row * 16])[:rows * per_row]  # a token is at most 16 characters here
    if len(ids) < per_row:
        raise ValueError(f"general_data ({description}) holds {len(ids)} tokens, fewer than the {per_row} of one row "
                         f"of seq_len {seq_len} + 1; give a longer text")
    rows = len(ids) // per_row
    return torch.tensor(ids[:rows * per_row]).view(rows, per_row)  # (R, seq_len + 1)


@dataclass
class Watch:
    """The evaluations of a run so far, and what they warn of (:meth:`add`), each warning once."""
    best_step: int | None = None  # the step of the lowest val loss after step 0 (None: none yet)
    best_val: float = math.inf
    start_val: float | None = None  # the val loss at step 0 (the model before training)
    start_general: float | None = None  # the general loss at step 0 (None: no general check)
    last_general: float | None = None  # the general loss of the last evaluation
    above_best: int = 0  # evaluations in a row since the best with a higher val loss
    warned: set[str] = field(default_factory=set)  # the kinds of warning given so far

    def add(self, step: int, val: float, general: float | None) -> list[str]:
        """Take the evaluation at ``step``; the warnings it raises that were not given before (empty:
        none). Whether it is the new best is ``self.best_step == step`` after the call."""
        self.last_general = general
        if step == 0:
            self.start_val, self.start_general = val, general
            return []
        if val < self.best_val:
            self.best_step, self.best_val, self.above_best = step, val, 0
        else:
            self.above_best += 1
        warnings = {}
        if self.above_best >= RISING:
            warnings["past best"] = (f"the val loss has been above its best ({self.best_val:.4f} at step "
                                     f"{self.best_step}) for {self.above_best} evaluations: the run is past its "
                                     f"best, which is kept as best.safetensors (sample, eval, export and serve take "
                                     f"it from the run folder)")
        if general is not None and self.start_general is not None and general > self.start_general + GENERAL_RISE:
            warnings["forgetting"] = (f"the general loss is {general:.4f}, {general - self.start_general:+.4f} nats "
                                      f"from the model's own {self.start_general:.4f} (perplexity "
                                      f"{math.exp(general - self.start_general) - 1:+.0%}): the fine-tune is making "
                                      f"the model forget; lower the learning rate, train fewer steps or mix general "
                                      f"data in (docs/finetune.md)")
        new = {kind: text for kind, text in warnings.items() if kind not in self.warned}
        self.warned |= set(new)
        return list(new.values())

    @classmethod
    def of(cls, records: list[dict]) -> Watch:
        """The watch of a resumed run: its log's evaluations replayed."""
        watch = cls()
        for r in records:
            if "val_loss" in r:
                watch.add(r["step"], r["val_loss"], r.get("general_loss"))
        return watch
