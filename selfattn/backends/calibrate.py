"""Calibrating ``auto`` to this machine: the kinds of request it is tuned for, timed, and the fastest
backend of each kept in this machine's cache file (:mod:`selfattn.backends.tuning`), which ``auto``
then follows. ``selfattn calibrate`` runs it; ``selfattn calibrate --show`` says what ``auto`` follows.

The kinds (:data:`KINDS`, the masks and score rules of ``python -m benchmarks masks`` too): sliding
windows of 256 and 2048, 16 equal packed documents, half the keys padding, plain causal, ALiBi,
soft-capping, a prefix of half the positions and a user ``mask_mod`` (chunks of 1024 positions and
64 global keys). For each, at a few sequence lengths, in each dtype and mode (forward under
``torch.no_grad``, forward+backward), the candidate backends that serve the request are timed
(:func:`selfattn.backends.tuning.measure`), B = 1, H = 8, D = 64 by default.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from selfattn.backends import auto, tuning
from selfattn.kernels.features import multiplies_natively
from selfattn.masks import Mask
from selfattn.scores import Scores, alibi_slopes

KINDS = ("window-256", "window-2048", "docs-16", "padding-50", "causal", "alibi", "softcap", "prefix-50", "mask_mod")
LENGTHS = (256, 1024, 4096)  # T = S timed by default


def chunked(b, h, q_idx, kv_idx):
    """The kind ``mask_mod``'s rule: chunks of 1024 positions, plus 64 global keys."""
    return (q_idx // 1024 == kv_idx // 1024) | (kv_idx < 64)


def attention_kwargs(kind: str, B: int, T: int, device, H: int = 8) -> dict:
    """``attention()`` keywords of a named kind over T positions (its mask, or its score rule)."""
    if kind.startswith("window-"):
        return {"window": int(kind.split("-")[1])}
    if kind.startswith("docs-"):
        n = int(kind.split("-")[1])
        return {"doc_ids": (torch.arange(T, device=device) * n // T).expand(B, T).contiguous()}  # (B, T), equal docs
    if kind.startswith("padding-"):
        pad = torch.ones(B, T, dtype=torch.bool, device=device)
        pad[:, :T * int(kind.split("-")[1]) // 100] = False  # left padding
        return {"key_padding_mask": pad}
    if kind.startswith("prefix-"):
        return {"prefix_len": T * int(kind.split("-")[1]) // 100}
    if kind in ("causal", "alibi", "softcap", "mask_mod"):
        return {"alibi": {"alibi_slopes": alibi_slopes(H).to(device)}, "softcap": {"softcap": 30.0},
                "mask_mod": {"mask_mod": chunked}}.get(kind, {})
    raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")


def request(kw: dict, B: int, H: int, device) -> tuple[Mask, Scores]:
    """The Mask and Scores that ``attention(**kw)`` builds (causal, B rows, H heads)."""
    prefix, user = kw.get("prefix_len"), kw.get("mask_mod")
    mask = Mask(window=kw.get("window"), key_padding_mask=kw.get("key_padding_mask"), doc_ids=kw.get("doc_ids"),
                prefix_len=None if prefix is None else torch.tensor([prefix], device=device), mask_mod=user,
                n_head=H if user else None, batch_rows=torch.arange(B, device=device) if user else None)
    return mask, Scores(alibi_slopes=kw.get("alibi_slopes"), softcap=kw.get("softcap"))


def inputs(B: int, H: int, T: int, D: int, device, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    """q, k, v and an output gradient ``(B, H, T, D)``, the same numbers for every dtype."""
    g = torch.Generator().manual_seed(seed + T)
    return tuple(torch.randn(B, H, T, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))


def default_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """float32, plus bfloat16 where the hardware computes it natively."""
    native = multiplies_natively(device, torch.bfloat16)
    return (torch.float32, torch.bfloat16) if native else (torch.float32,)


def calibrate(device: torch.device, *, kinds: tuple[str, ...] = KINDS, lengths: tuple[int, ...] = LENGTHS,
              dtypes: tuple[torch.dtype, ...] | None = None, batch: int = 1, n_head: int = 8, head_dim: int = 64,
              reps: int = 5, log: Callable[[dict], None] = lambda m: None) -> list[dict]:
    """Time ``auto``'s candidates for every kind, length, dtype and mode, and record the fastest of each
    in this machine's cache file; returns the measurements (``log`` is called with each as it comes)."""
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds must be among {', '.join(KINDS)}; bad: {bad or 'none given'}")
    if not lengths or not all(isinstance(T, int) and not isinstance(T, bool) and T > 0 for T in lengths):
        raise ValueError(f"lengths must be positive ints, got {lengths!r}")
    measured, seen = [], set()
    for dtype in dtypes or default_dtypes(device):
        for kind in kinds:
            for T in lengths:
                q, k, v, _ = inputs(batch, n_head, T, head_dim, device, dtype)
                mask, scores = request(attention_kwargs(kind, batch, T, device, n_head), batch, n_head, device)
                for grad in (False, True):
                    point = (tuning.key(q, mask, scores, T, grad), T, tuning.window(mask, T))
                    if point in seen:  # e.g. a window of 2048 at T = 1024 is plain causal, measured once
                        continue
                    seen.add(point)
                    m = dict(tuning.measure(q, k, v, mask, scores, grad, reps=reps,
                                            allow_compile=auto.allows_compile()), mask=kind)
                    measured.append(m)
                    log(m)
    tuning.record(device, measured)
    return measured


def show(device: torch.device) -> list[str]:
    """What ``auto`` follows on this machine, as lines: the cache file and its measurements, or why the rule."""
    file = tuning.path(device)
    tuning.forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = tuning.table(device)
    lines = [f"machine: {tuning.fingerprint(device)}", f"cache: {file}"]
    if caught:
        lines.append(f"{caught[0].message}")
    if not entries:
        lines.append("auto follows its measured rule (selfattn/backends/auto.py): nothing is calibrated here"
                     + ("" if file.exists() else "; run `selfattn calibrate`"))
        return lines
    lines.append(f"auto follows this machine's measurements for {len(entries)} kinds, each covering T·S within "
                 f"{tuning.REACH:g} octaves of a measured one; every other request follows its rule")
    for kind, ms in sorted(entries.items()):
        ms = sorted(ms, key=lambda m: (m["T"] * m["S"], m.get("window") or 0))
        lines.append(f"  {kind}: " + ", ".join(f"T={m['T']}" + (f" w={m['window']}" if m.get("window") else "")
                                               + f": {m['best']}" for m in ms))
    return lines
