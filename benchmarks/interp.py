"""``python -m benchmarks interp``: :mod:`selfattn.interp` against TransformerLens 4.3, in one run (docs/interp.md).

The model: SmolLM2-135M-Instruct, ours from its GGUF file (dequantised to float32), TransformerLens's
``TransformerBridge`` booted on a ``transformers`` folder of the same weights (written by
:func:`selfattn.io.export.export`, a ``LlamaForCausalLM`` folder; compatibility mode without weight processing, as
``tests/interp`` boots it); ``--quick``: a small random Llama-shaped model with byte tokens, written the same way.
Every row is float32, batch 1, under ``torch.no_grad``, the median of interleaved repetitions after a warm-up:

- ``forward``: our plain forward (``model(ids)``) on the first ``tokens`` tokens of the built-in corpus, the
  reference time;
- ``every site``: ``run_with_cache`` of every site on the same tokens, ours (``names=None``) against
  TransformerLens's with each head's result on (``set_use_attn_result(True)``), so that both keep every site,
  each head's ``hook_result`` included;
- ``3 sites``: ``run_with_cache`` of three sites asked by name (:func:`few_sites`: layer 0's pattern, the middle
  layer's ``hook_resid_post``, the last layer's ``hook_z``), ours ``names=[...]`` against theirs
  ``names_filter=[...]``, each head's result off;
- ``head sweep``: activation patching of each head's output (``hook_z``, all positions) from the clean prompt into
  the corrupted one, the metric the logit difference answer - wrong at the last position: ours
  ``patch(..., site="z", by="head")`` (the layers below each patch run once, the heads of a layer are rows of one
  batch) against ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` (one forward per head); each
  given its own clean run's cache of ``hook_z``, made before the clock starts.

Peak memory: what one call adds to the resident set (or the accelerator's allocator), the cache it returns
included (:class:`benchmarks.common.PeakMemory`), measured once per row after the timing.

Before timing (on the warm-up round's results): every site both ``run_with_cache`` keep, and the logits, are equal
within 1e-4 of the site's largest value (absolute where that is below 1; masked scores at -inf in the same places),
and so are the two head sweeps; :class:`benchmarks.common.CorrectnessError` otherwise.

Targets (the interp issue): ``run_with_cache`` of three sites at most 1.10x our plain forward; our head sweep at
least 3x faster than TransformerLens's; every common site and the sweep within 1e-4 of TransformerLens's.
"""
from __future__ import annotations

import contextlib
import functools
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from benchmarks import common
from benchmarks.decode import DEFAULT_CKPT
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.interp import logit_diff, patch, run_with_cache
from selfattn.model import GPT
from selfattn.training import data

OURS, THEIRS = "selfattn", "TransformerLens"
IMPLS = (OURS, THEIRS)
ROWS = ("forward", "every site", "3 sites", "head sweep")
FEW_OVERHEAD, SWEEP_SPEEDUP = 1.10, 3.0  # the targets: 3 sites / plain forward at most, their sweep / ours at least
TOLERANCE = common.TOLERANCE[torch.float32]  # 1e-4 of the largest value


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the model; None: a small random Llama-shaped one with byte tokens
    tokens: int = 128  # positions of the forward and cache rows: the built-in corpus's first tokens, batch 1
    clean: str = "The capital of France is"  # the head sweep's prompts: one number of tokens
    corrupt: str = "The capital of Italy is"
    answer: str = " Paris"  # the metric: logit(answer) - logit(wrong) at the last position, one token each
    wrong: str = " Rome"
    reps: int = 5  # timed repetitions of the forward and cache rows (median reported)
    sweep_reps: int = 3  # timed repetitions of the head sweeps
    memory: bool = True  # measure each row's peak memory

    def check(self) -> None:
        _validate.positive_ints(tokens=self.tokens, reps=self.reps, sweep_reps=self.sweep_reps)
        empty = [name for name in ("clean", "corrupt", "answer", "wrong") if not getattr(self, name)]
        if empty:
            raise ValueError(f"{', '.join(empty)} must be non-empty text")


FULL = Settings()
QUICK = Settings(ckpt=None, tokens=32, clean="The capital of Spain is", corrupt="The capital of Italy is",
                 answer="M", wrong="R", reps=2, sweep_reps=1)


def few_sites(n_layer: int) -> list[str]:
    """The three sites of the ``3 sites`` row: layer 0's attention pattern, the middle layer's residual stream out,
    the last layer's ``hook_z``."""
    return ["blocks.0.attn.hook_pattern", f"blocks.{n_layer // 2}.hook_resid_post",
            f"blocks.{n_layer - 1}.attn.hook_z"]


def _ours(settings: Settings):
    """(our model in float32 eval mode on the CPU, its tokenizer, its special tokens for the export, a name)."""
    from selfattn.io.export import Special

    if settings.ckpt is None:
        from selfattn.config import GPTConfig
        from selfattn.tokenizers import ByteTokenizer
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos="rope",
                              norm="rmsnorm", mlp_kind="swiglu", tie_embeddings=True))
        return model.eval(), ByteTokenizer(), None, "random Llama-shaped (2 layers, 4 heads, 2 KV heads, C=64)"
    if not Path(settings.ckpt).exists():
        raise ValueError(f"{settings.ckpt} is missing" + (": run `make models`" if settings.ckpt == DEFAULT_CKPT
                                                          else ""))
    from selfattn.io.loading import load
    loaded = load(settings.ckpt)
    return loaded.model.float().eval(), loaded.require_tokenizer(), Special.of(loaded), str(loaded.source)


def _bridge(model: GPT, tokenizer, special, folder: Path, device: torch.device):
    """TransformerLens's ``TransformerBridge`` on ``model``'s weights: ``model`` exported to ``folder`` as a
    ``transformers`` folder, booted from it in compatibility mode without weight processing (eval mode)."""
    from transformer_lens.model_bridge import TransformerBridge

    from selfattn.io.export import export
    export(model, tokenizer, folder, special=special)
    bridge = TransformerBridge.boot_transformers(str(folder), device=str(device), dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    return bridge.eval()


def _patching():
    """``transformer_lens.patching``; ValueError naming the extra to install where TransformerLens is missing."""
    try:
        from transformer_lens import patching
    except ImportError as e:
        raise ValueError(f"the interp suite needs TransformerLens 4.3 ({e}): pip install 'selfattn[dev]'") from e
    return patching


@contextlib.contextmanager
def _quiet():
    """TransformerLens's progress bar over the patches and transformers' over the weights off inside (the suite's
    output is its log lines), as they were after."""
    from transformers.utils import logging

    patching = _patching()
    bar, shown = patching.tqdm, logging.is_progress_bar_enabled()
    patching.tqdm = functools.partial(bar, disable=True)
    logging.disable_progress_bar()
    try:
        yield
    finally:
        patching.tqdm = bar
        if shown:
            logging.enable_progress_bar()


def _one_token(tokenizer, text: str, what: str) -> int:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} must be one token, it is {len(ids)}: {ids}")
    return ids[0]


def _prompts(tokenizer, settings: Settings, device: torch.device) -> tuple[Tensor, Tensor, int, int]:
    """(clean ids (1, T), corrupted ids (1, T), answer id, wrong id); prompts of two lengths are refused."""
    clean, corrupt = tokenizer.encode(settings.clean), tokenizer.encode(settings.corrupt)
    if len(clean) != len(corrupt):
        raise ValueError(f"the clean prompt {settings.clean!r} is {len(clean)} tokens and the corrupted one "
                         f"{settings.corrupt!r} {len(corrupt)}: patching needs one length")
    ids = torch.tensor([clean, corrupt], device=device)  # (2, T)
    return (ids[:1], ids[1:], _one_token(tokenizer, settings.answer, "answer"),
            _one_token(tokenizer, settings.wrong, "wrong"))


def _corpus(tokenizer, tokens: int, device: torch.device) -> Tensor:
    """The built-in corpus's first ``tokens`` tokens, ``(1, tokens)``."""
    text, _ = data.read_corpus(None)
    ids = tokenizer.encode(text[:16 * tokens])  # a token is rarely over 16 characters
    if len(ids) < tokens:
        raise ValueError(f"the built-in corpus's first {16 * tokens} characters are {len(ids)} tokens, fewer than "
                         f"tokens={tokens}")
    return torch.tensor(ids[:tokens], device=device)[None]  # (1, T)


def site_error(ours: Tensor, theirs: Tensor, name: str) -> float:
    """max |ours - theirs| / max |theirs| (over 1 where that is below 1), positions at -inf (masked scores)
    skipped; :class:`~benchmarks.common.CorrectnessError` when the shapes or the masked positions differ."""
    a, t = ours.detach().double().cpu(), theirs.detach().double().cpu()
    if a.shape != t.shape:
        raise common.CorrectnessError(f"{name}: shape {tuple(a.shape)} where TransformerLens has {tuple(t.shape)}")
    hidden = torch.isinf(t) & (t < 0)
    if not torch.equal(hidden, torch.isinf(a) & (a < 0)):
        raise common.CorrectnessError(f"{name}: masked (-inf) in other places than TransformerLens's")
    diff = (a - t).masked_fill(hidden, 0)
    return (diff.abs().amax() / t.masked_fill(hidden, 0).abs().amax().clamp(min=1)).item()


def check_caches(ours: tuple[Tensor, dict], theirs: tuple[Tensor, object], required: set[str], what: str) -> dict:
    """The logits and every site both caches hold within :data:`TOLERANCE`, the ``required`` sites among them.
    Returns the count of sites compared, the largest error and where."""
    (our_logits, mine), (their_logits, cache) = ours, theirs
    common_sites = [name for name in mine if name in cache]
    if not required <= set(common_sites):
        raise common.CorrectnessError(f"{what}: the caches do not both hold {sorted(required - set(common_sites))}")
    errors = {"logits": site_error(our_logits, their_logits, "logits")}
    errors |= {name: site_error(mine[name], cache[name], name) for name in common_sites}
    where = max(errors, key=errors.get)
    if not errors[where] <= TOLERANCE:
        raise common.CorrectnessError(f"{what}: {where} differs from TransformerLens's by {errors[where]:.2e} of its "
                                      f"largest value > {TOLERANCE:g}; refusing to time caches that hold something "
                                      f"else")
    return {"sites": len(common_sites), "error": errors[where], "where": where}


def check_sweeps(ours: Tensor, theirs: Tensor) -> float:
    """The two head sweeps ``(L, H)`` within :data:`TOLERANCE` of the largest value; returns the error."""
    error = site_error(ours, theirs, "head sweep")
    if not error <= TOLERANCE:
        raise common.CorrectnessError(f"head sweep: ours differs from TransformerLens's by {error:.2e} of the largest "
                                      f"value > {TOLERANCE:g}; refusing to time a sweep that computes something else")
    return error


def _timed(fns: dict, device: torch.device, reps: int, check) -> dict[str, list[float]]:
    """Interleaved timings of ``fns`` after one warm-up round, whose results go to ``check(results)`` before the
    first timed round (and are let go after it)."""
    results = {}

    def keep(name: str, result) -> None:
        results[name] = result
        if len(results) == len(fns):
            check(results)
            results.clear()
    times, out_of_memory = common.interleaved(fns, device, warmup=1, reps=reps, on_warmup=keep)
    if out_of_memory:
        raise ValueError(f"out of memory: {out_of_memory}; try a smaller --tokens")
    return times


def _cache_rows(ours: GPT, bridge, ids: Tensor, settings: Settings, device: torch.device, peak) -> tuple[list, dict]:
    """The forward, every-site and 3-site rows (interleaved together) and their checks."""
    few = few_sites(len(ours.blocks))

    def theirs(names, result: bool):  # each head's result only where every site is asked, as ours computes it
        bridge.set_use_attn_result(result)
        return bridge.run_with_cache(ids, names_filter=names)
    fns = {("forward", OURS): lambda: ours(ids),
           ("every site", THEIRS): lambda: theirs(None, True), ("every site", OURS): lambda: run_with_cache(ours, ids),
           ("3 sites", THEIRS): lambda: theirs(few, False), ("3 sites", OURS): lambda: run_with_cache(ours, ids, few)}
    L, checks = len(ours.blocks), {}
    required = {"every site": {f"blocks.{i}.{site}" for i in range(L) for site in ("attn.hook_z", "hook_resid_post")},
                "3 sites": set(few)}

    def check(results: dict) -> None:
        for row in ("every site", "3 sites"):
            checks[row] = check_caches(results[(row, OURS)], results[(row, THEIRS)], required[row], row)
    times = _timed(fns, device, settings.reps, check)
    rows = _rows(fns, times, settings, peak)
    bridge.set_use_attn_result(False)
    return rows, checks


def _sweep_rows(ours: GPT, bridge, settings: Settings, prompts, device: torch.device, peak) -> tuple[list, dict]:
    """The head sweep, ours and TransformerLens's (interleaved), and its check."""
    patching = _patching()
    clean_ids, corrupt_ids, answer, wrong = prompts
    metric = logit_diff(answer, wrong)  # over the leading axes: (P, B, T, V) -> (P,) for ours, (B, T, V) -> ()
    is_z = lambda name: name.endswith("attn.hook_z")
    _, our_clean = run_with_cache(ours, clean_ids, names=is_z)
    _, their_clean = bridge.run_with_cache(clean_ids, names_filter=is_z)
    fns = {("head sweep", THEIRS): lambda: patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt_ids,
                                                                                         their_clean, metric),
           ("head sweep", OURS): lambda: patch(ours, corrupt_ids, our_clean, metric, site="z", by="head")}
    checks = {"metric_clean": metric(ours(clean_ids)[0]).item(), "metric_corrupt": metric(ours(corrupt_ids)[0]).item()}

    def check(results: dict) -> None:
        checks["error"] = check_sweeps(results[("head sweep", OURS)], results[("head sweep", THEIRS)])
    times = _timed(fns, device, settings.sweep_reps, check)
    return _rows(fns, times, settings, peak), checks


def _rows(fns: dict, times: dict, settings: Settings, peak) -> list[dict]:
    """One row a function: its median time and timings, and its peak memory (one more call) where asked."""
    return [{"row": row, "impl": impl, "time_s": common.median(times[(row, impl)]), "times_s": times[(row, impl)],
             "peak_bytes": peak.growth(fns[(row, impl)])[0] if settings.memory else None}
            for row, impl in sorted(fns, key=lambda key: (ROWS.index(key[0]), IMPLS.index(key[1])))]


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    model, tokenizer, special, name = _ours(settings)
    with _quiet(), tempfile.TemporaryDirectory(prefix="interp-") as folder, torch.no_grad():
        bridge = _bridge(model, tokenizer, special, Path(folder) / "model", device)
        ours = model.to(device)
        ids = _corpus(tokenizer, settings.tokens, device)
        prompts = _prompts(tokenizer, settings, device)
        log(f"model: {name}, {ours.num_params() / 1e6:.1f}M parameters; {settings.tokens} tokens; head sweep over "
            f"{len(ours.blocks)} x {ours.config.n_head} heads, {prompts[0].shape[1]}-token prompts")
        peak = common.PeakMemory(device)
        rows, checks = _cache_rows(ours, bridge, ids, settings, device, peak)
        log(", ".join(f"{r['row']} {r['impl']} {r['time_s'] * 1e3:.1f} ms" for r in rows))
        sweep_rows, checks["head sweep"] = _sweep_rows(ours, bridge, settings, prompts, device, peak)
        log(", ".join(f"{r['row']} {r['impl']} {r['time_s']:.2f} s" for r in sweep_rows))
    rows += sweep_rows
    return {"suite": "interp", "machine": info, "settings": asdict(settings), "model": name,
            "params": ours.num_params(), "n_layer": len(ours.blocks), "n_head": ours.config.n_head,
            "few_sites": few_sites(len(ours.blocks)), "checks": checks, "results": rows,
            "targets": _targets(rows, checks)}


def _time(rows: list[dict], row: str, impl: str) -> float:
    return next(r["time_s"] for r in rows if r["row"] == row and r["impl"] == impl)


def _targets(rows: list[dict], checks: dict) -> list[dict]:
    few = _time(rows, "3 sites", OURS) / _time(rows, "forward", OURS)
    sweep = _time(rows, "head sweep", THEIRS) / _time(rows, "head sweep", OURS)
    cached = max(checks["every site"]["error"], checks["3 sites"]["error"])
    errors = f"sites {cached:.1e} ({checks['every site']['where']}), head sweep {checks['head sweep']['error']:.1e}"
    return [common.target(f"run_with_cache of 3 sites at most {FEW_OVERHEAD:.2f}x our plain forward",
                          few <= FEW_OVERHEAD, f"{few:.2f}x"),
            common.target(f"head sweep at least {SWEEP_SPEEDUP:g}x faster than TransformerLens's",
                          sweep >= SWEEP_SPEEDUP, f"{sweep:.1f}x"),
            common.target(f"every common site and the head sweep within {TOLERANCE:g} of TransformerLens's",
                          cached <= TOLERANCE and checks["head sweep"]["error"] <= TOLERANCE, errors)]


def report(result: dict) -> str:
    s, rows, checks = result["settings"], result["results"], result["checks"]
    forward = _time(rows, "forward", OURS)
    mib = lambda b: "-" if b is None else f"{b / 2 ** 20:.1f}"
    body = [[r["row"], r["impl"], f"{r['time_s'] * 1e3:.2f}",
             f"{r['time_s'] / forward:.2f}" if r["row"] != "head sweep" else "-",
             f"{_time(rows, r['row'], THEIRS) / r['time_s']:.2f}" if r["impl"] == OURS and r["row"] != "forward"
             else "-", mib(r["peak_bytes"])] for r in rows]
    sweep = checks["head sweep"]
    return "\n".join([
        "", f"interp: {result['model']}, {result['params'] / 1e6:.1f}M parameters, float32, batch 1; forward and "
            f"caches on {s['tokens']} tokens; 3 sites: {', '.join(result['few_sites'])}; head sweep: "
            f"{result['n_layer']} x {result['n_head']} heads, {s['clean']!r} -> {s['corrupt']!r}, "
            f"logit({s['answer']!r}) - logit({s['wrong']!r})",
        common.table(["row", "impl", "median ms", "x forward", "TL / ours", "peak MiB"], body),
        f"checks: every site: {checks['every site']['sites']} sites in common, largest error "
        f"{checks['every site']['error']:.1e} ({checks['every site']['where']}); 3 sites: "
        f"{checks['3 sites']['error']:.1e}; head sweep {sweep['error']:.1e}, metric clean {sweep['metric_clean']:.3f}, "
        f"corrupted {sweep['metric_corrupt']:.3f}",
        common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    rows = result["results"]
    fig = _plot.figure(figsize=(7, 4))
    ax = fig.subplots()
    at = range(len(ROWS))
    for shift, impl in ((-0.2, OURS), (0.2, THEIRS)):
        present = [(i, r["time_s"]) for i, row in enumerate(ROWS) for r in rows if r["row"] == row
                   and r["impl"] == impl]
        ax.bar([i + shift for i, _ in present], [t for _, t in present], width=0.4, label=impl)
    forward = _time(rows, "forward", OURS)
    ax.axhline(forward * FEW_OVERHEAD, color="grey", linestyle="--", linewidth=1,
               label=f"our plain forward x {FEW_OVERHEAD:.2f}")
    ax.set_xticks(list(at), ROWS)
    ax.set_yscale("log")
    ax.set(ylabel="median seconds (log)", title=f"python -m benchmarks interp ({result['machine']['device']}, "
                                                f"{result['params'] / 1e6:.1f}M params)")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
