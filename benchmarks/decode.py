"""``python -m benchmarks decode``: prefill time, decode tokens/s, the memory roofline and peak memory.

Two kinds of model, each in every dtype of ``dtypes`` and at every batch size of ``batches``:

- the **GPT-2-small shape** (random weights built offline: a ``GPT2Config``, a randomly initialised
  ``GPT2LMHeadModel``, converted by :func:`selfattn.io.hf.from_hf`; nothing is downloaded), after
  each prompt length of ``prompts``;
- a **checkpoint** (``ckpt``: any path :func:`selfattn.io.loading.load` takes; by default
  SmolLM2-135M-Instruct's GGUF file where ``make models`` puts it, its rows marked unavailable
  when it is absent), after a prompt of ``ckpt_prompt`` tokens.

Implementations, all greedy on the same weights, dtype and threads:

- ``kv-cache``: our ``generate``: the prompt prefilled once, then one token per step against
  the preallocated KV cache, on a model prepared as ``docs/gpt.md`` shows
  (``decode_layout(model.eval())``);
- ``compiled``: the documented one call of the fast path, ``compile_decode(model)`` on a copy of the
  model as loaded (each step one call of the C++ decode kernel where it serves the model, else one
  compiled graph); its untimed first run compiles, and ``first_s`` - ``time_s`` of its row is about
  that cost. The check records which path it took (``compiled_path``): the kernel wherever
  ``selfattn.generation.kernel_step.unsupported`` serves the model, a target of the run;
- ``hf-sdpa``, ``hf-eager``: ``transformers``' ``generate`` (its own dynamic cache) with its SDPA
  and its eager attention, on a ``transformers`` model holding *our* tensors (GPT-2:
  :func:`selfattn.io.hf.to_hf`; a family: :func:`selfattn.families.writing.folder_tensors` under the
  family's ``config.json``), so the weights are identical bit for bit. The GPT-2 rows time
  ``hf-sdpa`` only (transformers' default there);
- ``no-cache`` (GPT-2 shape, batch 1, the first dtype): our GPT without a cache, every step
  running the whole sequence again. A no-cache step costs what its context costs, so one step
  is timed at each of ``no_cache_samples`` context lengths spaced evenly over the generation
  (midpoints of equal slices) and the total is the midpoint-rule sum; the row says ``estimated``.

What a row reports. ``prefill_s``: from the call to the first new token (the prompt's forward,
the head on its last position, the argmax). ``decode_s``: the N - 1 steps after it; a step feeds
B tokens (one per row) and yields B. ``decode_tokens_per_s`` = B (N - 1) / decode_s;
``tokens_per_s`` = B N / (prefill_s + decode_s), prefill included. Ours is split by its
streaming iterator, transformers' by a stopping criterion that reads the clock when it is first
asked (after the first new token). Medians of ``reps`` interleaved repetitions (the order rotated
each round) after one untimed full-length run per implementation, which also measures memory.

The roofline (:func:`step_bytes`): a decode step reads every weight once, in the dtype it is
stored in (an embedding table only its B looked-up rows, unless it is also the head), and each
layer's cached keys and values up to the step's position (a sliding-window layer its window).
``bytes_per_step`` is that averaged over the N - 1 decode steps; ``achieved_gbps`` =
bytes_per_step / (decode_s / (N - 1)); the fraction of the roofline = achieved / this machine's
streaming bandwidth while the row ran, ``bandwidth_gbps``: a sum over ``bandwidth_mib`` MiB
(:class:`benchmarks.common.BandwidthProbe`) timed just before and just after each of the row's
runs, the median over its runs of the two's mean (on a shared VM the bandwidth moves from one
minute to the next: read against a probe taken among the case's rows, up to a dozen seconds away,
SmolLM2's float32 row showed 1.00 and its bfloat16 one 0.63 in one run, 29.9 and 31.6 GB/s
against probes of 29.8 and 50.2). The whole test (:func:`benchmarks.common.stream_bandwidth`: sum,
copy and matrix-vector product) runs before and after the rows too, for the record. A batch-1
step of a memory-bound decoder cannot beat 1.0; a batch of B reuses each weight B times.

Peak memory (:class:`benchmarks.common.PeakMemory`): the resident-set growth of the untimed
full-length call over what was resident before it (the freed heap trimmed, the high-water mark
reset), plus the weights, which were resident already: ``peak_bytes`` = weight bytes + growth,
against ``weights + cache`` (the cache of prompt + N - 1 positions in the model's dtype).

Before timing, per model and dtype: our logits equal transformers' on the same tokens (float32
within its tolerance; bfloat16, each against the float32 model: ours at most twice
transformers' error plus 2% of the logits' range), and our cached, token-by-token logits equal our full-sequence logits
(teacher forcing). Whether ours and transformers' greedy tokens agree is recorded, not required
(a near-tie between two logits may break either way under other rounding).
"""
from __future__ import annotations

import copy
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks import assets, common
from selfattn._util import plot as _plot
from selfattn._util.validate import positive_ints
from selfattn.config import GPTConfig
from selfattn.generation import compile_decode, decode_layout, generate
from selfattn.generation.compiled import compiled_of
from selfattn.generation.kernel_step import unsupported
from selfattn.generation.steps import Steps, steps_of
from selfattn.model import GPT

IMPLS = ("kv-cache", "compiled", "hf-sdpa", "hf-eager", "no-cache")
OURS = ("kv-cache", "compiled")  # our decoding, eager and compiled; the targets take the faster
HF_IMPLS = {"hf-sdpa": "sdpa", "hf-eager": "eager"}  # impl -> transformers' attn_implementation
GPT2_MODEL = "gpt2-small-shape"
DEFAULT_CKPT = str(assets.SMOLLM2.path)  # SmolLM2-135M-Instruct's GGUF file, where `make models` keeps it


@dataclass
class Settings:
    n_layer: int = 12  # GPT-2 small
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    prompts: tuple[int, ...] = (16, 512)  # GPT-2-shape prompt lengths
    new_tokens: int = 128  # tokens generated after each GPT-2-shape prompt
    batches: tuple[int, ...] = (1, 8)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    reps: int = 3  # timed generations per implementation (median reported)
    no_cache_samples: int = 8  # context lengths at which a no-cache step is timed
    check_tokens: int = 16  # teacher-forced positions in the correctness check
    ckpt: str | None = DEFAULT_CKPT  # a model to bench as well; None: GPT-2 shape only
    ckpt_prompt: int = 512
    ckpt_new_tokens: int = 128
    bandwidth_mib: int = 1024  # size of the streaming-bandwidth test
    bandwidth_reps: int = 5
    memory: bool = True  # measure peak memory

    def check(self) -> None:
        positive_ints(**{name: v for name, v in asdict(self).items()
                         if name not in ("prompts", "batches", "dtypes", "ckpt", "memory")})
        too_long = [P for P in self.prompts if P <= 0 or P + self.new_tokens > self.block_size]
        if not self.prompts or too_long:
            raise ValueError(f"prompt lengths must be positive with prompt + new_tokens={self.new_tokens} <= "
                             f"block_size={self.block_size}; bad: {too_long or 'none given'}")
        if self.new_tokens < 2 or self.ckpt_new_tokens < 2:
            raise ValueError(f"new_tokens and ckpt_new_tokens must be >= 2 (a first token, then decode steps), got "
                             f"{self.new_tokens} and {self.ckpt_new_tokens}")
        bad_batch = [b for b in self.batches if not isinstance(b, int) or isinstance(b, bool) or b <= 0]
        if not self.batches or bad_batch:
            raise ValueError(f"batches must be positive ints, got {list(self.batches)}")
        bad = [d for d in self.dtypes if d not in common.DTYPES]
        if not self.dtypes or bad:
            raise ValueError(f"dtypes must be some of {', '.join(common.DTYPES)}, got {list(self.dtypes)}")


FULL = Settings()
QUICK = Settings(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=128, prompts=(8, 96), new_tokens=32,
                 batches=(1, 2), no_cache_samples=4, check_tokens=8, ckpt=None, ckpt_prompt=32, ckpt_new_tokens=16,
                 bandwidth_mib=64)


def models(settings: Settings, device: torch.device):
    """(ours, transformers' model or None, why None): the same random GPT-2 weights, float32."""
    try:
        import transformers
    except ImportError as e:
        torch.manual_seed(0)
        ours = GPT(GPTConfig(vocab_size=settings.vocab_size, block_size=settings.block_size,
                             n_layer=settings.n_layer, n_head=settings.n_head, n_embd=settings.n_embd, bias=True))
        return decode_layout(ours.to(device).eval()), None, f"needs transformers ({e}): pip install 'selfattn[hf]'"
    from selfattn.io.hf import from_hf
    config = transformers.GPT2Config(vocab_size=settings.vocab_size, n_positions=settings.block_size,
                                     n_embd=settings.n_embd, n_layer=settings.n_layer, n_head=settings.n_head,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)  # no early stop: every run is full length
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).to(device).eval()
    return decode_layout(from_hf(hf).eval()), _no_early_stop(hf), None


def hf_twin(ours: GPT):
    """(a ``transformers`` model holding ``ours``' tensors, in its dtype and device, or None, why None)."""
    try:
        import transformers
    except ImportError as e:
        return None, f"needs transformers ({e}): pip install 'selfattn[hf]'"
    from selfattn.families import writing
    from selfattn.io import export, hf
    if not export.unsupported(ours.config):
        return _no_early_stop(hf.to_hf(ours).eval()), None
    found = writing.folder_config(ours.config)
    if found is None:
        return None, f"no transformers family of {', '.join(writing.ARCHS)} computes this decoder"
    model_type, hf_config = found
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in hf_config.items() if k != "model_type"})
    w = ours.wte.weight
    with torch.device(w.device):
        twin = transformers.AutoModelForCausalLM.from_config(config, dtype=w.dtype)
    missing, unexpected = twin.load_state_dict(writing.folder_tensors(model_type, ours), strict=False)
    tied = {"lm_head.weight"} if ours.config.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise common.CorrectnessError(f"transformers' {type(twin).__name__} lacks {unexpected} or misses {missing} "
                                      f"of our tensors")
    return _no_early_stop(twin.eval()), None


def _no_early_stop(hf):
    """Every run generates all its tokens: no eos, no pad warning."""
    for config in (hf.config, hf.generation_config):
        config.eos_token_id = None
        config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def step_bytes(model: GPT, batch: int, keys: int) -> dict:
    """Bytes one decode step of ``batch`` rows reads when each layer's cache holds ``keys``
    positions after the step's own: ``{"weights": ..., "kv": ...}``.

    weights: every parameter and buffer once, in the dtype it is stored in (a tensor shared by
    two modules, as a tied embedding and head, once), except an embedding table no other module
    uses, of which only the ``batch`` looked-up rows are read. kv: each layer's keys and values,
    ``2 · batch · Hkv · S · D`` elements, with S = ``keys`` or, on a sliding-window layer, at most
    its window (plus sink tokens).
    """
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    elsewhere = {id(t) for m in model.modules() if not isinstance(m, nn.Embedding)
                 for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    weights, seen = 0, set()
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            rows = id(t) in tables and id(t) not in elsewhere
            weights += (batch * t[0].numel() if rows else t.numel()) * t.element_size()
    kv = 0
    elem = model.wte.weight.element_size()  # the cache is in the model's dtype (GPT.new_cache)
    for block in model.blocks:
        a = block.attn
        S = keys if a.window is None else min(keys, a.window + (a.sink_tokens or 0))
        kv += 2 * batch * a.n_kv_head * S * a.head_dim * elem
    return {"weights": weights, "kv": kv}


def roofline(model: GPT, batch: int, prompt: int, new_tokens: int) -> dict:
    """Bytes a generation reads per decode step, averaged over its ``new_tokens - 1`` steps (step
    j feeds the token at position prompt + j - 1 and attends over prompt + j keys), and the bytes
    of the weights and of the full cache (prompt + new_tokens - 1 positions)."""
    steps = [step_bytes(model, batch, prompt + j) for j in range(1, new_tokens)]
    weights = steps[0]["weights"]
    kv = sum(s["kv"] for s in steps) / len(steps)
    cache = step_bytes(model, batch, prompt + new_tokens - 1)["kv"]
    return {"weight_bytes": weights, "kv_bytes_per_step": kv, "bytes_per_step": weights + kv, "cache_bytes": cache}


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    before = _bandwidth(settings, device, "before the rows", log)
    probe = common.BandwidthProbe(device, settings.bandwidth_mib * 2 ** 20)
    peak = common.PeakMemory(device) if settings.memory else None
    if peak is not None and peak.unavailable:
        log(f"peak memory not measured: {peak.unavailable}")
    ours32, hf32, hf_missing = models(settings, device)
    log(f"model {GPT2_MODEL}: {settings.n_layer} layers, C={settings.n_embd}, H={settings.n_head}, "
        f"V={settings.vocab_size}: {ours32.num_params() / 1e6:.1f}M parameters (random weights), "
        f"attention backend {ours32.config.backend}")
    g = torch.Generator().manual_seed(0)
    rows, checks = [], []
    for dtype in settings.dtypes:
        ours, hf = _in_dtype(ours32, dtype), None
        compiled = _one_call(ours32, dtype)
        if hf32 is not None:
            from selfattn.io.hf import to_hf
            hf = _no_early_stop(to_hf(ours).eval())
        checks.append(_check(ours, hf, torch.randint(settings.vocab_size, (1, settings.prompts[0]), generator=g)
                             .to(device), settings, GPT2_MODEL, dtype, ours32, compiled))
        for B in settings.batches:
            for P in settings.prompts:
                idx = torch.randint(settings.vocab_size, (B, P), generator=g).to(device)  # (B, P)
                impls = {"kv-cache": ours, "compiled": compiled} | ({"hf-sdpa": hf} if hf is not None else {})
                rows += _time_case(GPT2_MODEL, dtype, ours, impls, idx, settings.new_tokens, settings, device,
                                   peak, probe, log, missing={"hf-sdpa": hf_missing} if hf is None else {})
                if B == 1 and dtype == settings.dtypes[0]:
                    rows.append(_no_cache_row(ours, idx, settings, device, dtype))
        del ours, compiled, hf
    ckpt_info = None
    if settings.ckpt is not None:
        ckpt_info, ckpt_rows, ckpt_checks = _ckpt_rows(settings, device, peak, probe, g, log)
        rows += ckpt_rows
        checks += ckpt_checks
    del probe
    after = _bandwidth(settings, device, "after the rows", log)
    bw = max(before, after, key=lambda b: b["gbps"]) | {"before": before, "after": after}
    result = {"suite": "decode", "machine": info, "settings": asdict(settings), "bandwidth": bw,
              "params": ours32.num_params(), "ckpt": ckpt_info, "checks": checks, "results": rows}
    result["targets"] = targets(result)
    return result


def _bandwidth(settings: Settings, device, when: str, log) -> dict:
    bw = common.stream_bandwidth(device, settings.bandwidth_mib * 2 ** 20, settings.bandwidth_reps)
    log(f"streaming bandwidth {when}, over {bw['bytes'] / 2 ** 20:.0f} MiB: sum {bw['sum_gbps']:.1f}, copy "
        f"{bw['copy_gbps']:.1f}, matvec {bw['matvec_gbps']:.1f} GB/s")
    return bw


def _in_dtype(model: GPT, dtype: str) -> GPT:
    return decode_layout(copy.deepcopy(model).to(common.DTYPES[dtype]).eval())


def _one_call(model: GPT, dtype: str) -> GPT:
    """The ``compiled`` rows' model: the documented one call, ``compile_decode(model)``, on a copy of
    the model as it was loaded (it lays the weights out itself): what a library user gets."""
    return compile_decode(copy.deepcopy(model).to(common.DTYPES[dtype]).eval())


def _ckpt_rows(settings: Settings, device, peak, probe, g, log) -> tuple[dict, list[dict], list[dict]]:
    from selfattn.io.loading import load
    path = Path(settings.ckpt)
    name = path.name if path.is_dir() else path.stem
    P, N = settings.ckpt_prompt, settings.ckpt_new_tokens
    if not path.exists():
        why = f"{path} is missing" + (": run `make models`" if settings.ckpt == DEFAULT_CKPT else "")
        log(f"model {name}: not measured, {why}")
        return ({"path": str(path), "status": "unavailable", "reason": why},
                [{"model": name, "impl": impl, "dtype": d, "batch": B, "prompt": P, "new_tokens": N,
                  "status": "unavailable", "reason": why}
                 for d in settings.dtypes for B in settings.batches for impl in (*OURS, *HF_IMPLS)], [])
    base = load(path).model.to(device).eval()
    if base.max_positions is not None and P + N - 1 > base.max_positions:
        raise ValueError(f"{path}: prompt {P} + {N} new tokens exceeds its block_size={base.config.block_size}")
    info = {"path": str(path), "status": "ok", "name": name, "params": base.num_params(),
            "n_layer": base.config.n_layer,
            "n_embd": base.config.n_embd, "n_head": base.config.n_head,
            "n_kv_head": base.config.n_kv_head or base.config.n_head, "vocab_size": base.config.vocab_size}
    log(f"model {name}: {info['n_layer']} layers, C={info['n_embd']}, H={info['n_head']}, Hkv={info['n_kv_head']}, "
        f"V={info['vocab_size']}: {info['params'] / 1e6:.1f}M parameters, from {path}")
    rows, checks = [], []
    V = base.config.vocab_size
    for dtype in settings.dtypes:
        ours = _in_dtype(base, dtype)
        compiled = _one_call(base, dtype)
        hf, why = hf_twin(ours)
        checks.append(_check(ours, hf, torch.randint(V, (1, min(P, 32)), generator=g).to(device), settings, name,
                             dtype, base, compiled))
        for B in settings.batches:
            idx = torch.randint(V, (B, P), generator=g).to(device)  # (B, P)
            impls = {"kv-cache": ours, "compiled": compiled} | (dict.fromkeys(HF_IMPLS, hf) if hf is not None else {})
            rows += _time_case(name, dtype, ours, impls, idx, N, settings, device, peak, probe, log,
                               missing=dict.fromkeys(HF_IMPLS, why) if hf is None else {})
        del ours, compiled, hf
    return info, rows, checks


@torch.inference_mode()
def _check(ours: GPT, hf, idx: torch.Tensor, settings: Settings, model: str, dtype: str, reference: GPT,
           compiled: GPT) -> dict:
    """Logits ours vs transformers (full sequence; in low precision each against ``reference``, the
    float32 model), and cached vs full (teacher forcing), eager and ``compiled`` (its first compile)."""
    P, k, V = idx.shape[1], settings.check_tokens, ours.config.vocab_size
    seq = torch.cat([idx, torch.randint(V, (1, k), device=idx.device)], dim=1)  # (1, P + k)
    full = ours(seq)[0]  # (1, P + k, V)
    tol = common.DTYPES[dtype]
    out = {"model": model, "dtype": dtype, "prompt": P}
    if hf is not None:
        what = f"decode: our logits vs transformers' ({model}, {dtype}, prompt {P})"
        if tol == torch.float32:
            out["vs_hf_err"] = common.check_close(what, full, hf(seq).logits, tol)
        else:  # each rounding against the float32 model, not one against the other
            out["vs_fp32_err"], out["hf_vs_fp32_err"] = common.check_rounding(what, full, hf(seq).logits,
                                                                              reference(seq)[0])
    for key, step, what in (("cache_err", Steps(ours).step, "cached step"),
                            ("compiled_err", steps_of(compiled).step, "compiled step")):
        cache = ours.new_cache(1, P + k)
        steps = [ours(seq[:, :P], cache=cache)[0][:, -1]]  # (1, V) after the prompt
        steps += [step(seq[:, i:i + 1], None, cache, i) for i in range(P, P + k - 1)]
        out[key] = common.check_close(f"decode: {what} logits vs full-sequence logits ({model}, {dtype}, prompt {P})",
                                      torch.stack(steps, 1), full[:, P - 1:P + k - 1], tol)
    kernel = compiled_of(compiled).kernel is not None
    out["compiled_path"], out["kernel_serves"] = "kernel" if kernel else "graph", unsupported(ours) is None
    return out


def _ours(model: GPT, idx: torch.Tensor, n: int, device) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds, tokens (B, n)) of our greedy generation."""
    common.sync(device)
    start = time.perf_counter()
    it = generate(model, idx, n, temperature=0.0)
    toks = [next(it)]
    common.sync(device)
    first = time.perf_counter()
    toks += list(it)
    common.sync(device)
    return first - start, time.perf_counter() - first, torch.stack(toks, dim=1)


def _hf(hf, attn: str, idx: torch.Tensor, n: int, device) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds, tokens (B, n)) of transformers' greedy generate with ``attn``."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstToken(StoppingCriteria):  # asked after every new token; never stops a run
        first = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.first is None:
                common.sync(device)
                self.first = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    hf.set_attn_implementation(attn)
    clock = FirstToken()
    common.sync(device)
    start = time.perf_counter()
    out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, do_sample=False, use_cache=True,
                      stopping_criteria=StoppingCriteriaList([clock]))
    common.sync(device)
    end = time.perf_counter()
    return clock.first - start, end - clock.first, out[:, idx.shape[1]:]


def _time_case(model_name: str, dtype: str, ours: GPT, impls: dict, idx: torch.Tensor, N: int, settings: Settings,
               device, peak, probe, log, missing: dict) -> list[dict]:
    """Rows for one (model, dtype, batch, prompt): every implementation timed, interleaved with
    each other, each run between two of ``probe``'s sums: the bandwidth its roofline fraction is read against."""
    B, P = idx.shape
    runs = {name: (lambda m=m: _ours(m, idx, N, device)) if name in OURS else
            (lambda m=m, a=HF_IMPLS[name]: _hf(m, a, idx, N, device)) for name, m in impls.items()}
    grown, tokens, first = {}, {}, {}
    for name, fn in runs.items():  # untimed, full length: the warm-up (a compile), and the peak memory
        start = time.perf_counter()
        grown[name], (_, _, tokens[name]) = peak.growth(fn) if peak is not None else (None, fn())
        first[name] = time.perf_counter() - start
    splits, around = {name: [] for name in runs}, {name: [] for name in runs}

    def between_probes(name: str) -> None:  # a run, and the bandwidth a probe just before and one just after read
        before = common.timed(probe, device)[0]
        splits[name].append(runs[name]()[:2])
        around[name].append(probe.gbps([before, common.timed(probe, device)[0]]))

    _, oom = common.interleaved({name: functools.partial(between_probes, name) for name in runs}, device, warmup=0,
                                reps=settings.reps)
    roof = roofline(ours, B, P, N)
    rows = []
    for name in runs:
        base = {"model": model_name, "impl": name, "dtype": dtype, "batch": B, "prompt": P, "new_tokens": N}
        if name in oom:
            rows.append(base | {"status": "out of memory", "reason": oom[name]})
            continue
        prefill = common.median([s[0] for s in splits[name]])
        decode = common.median([s[1] for s in splits[name]])
        step, times, gbps = decode / (N - 1), [sum(s) for s in splits[name]], common.median(around[name])
        row = base | {"status": "ok", "estimated": False, "prefill_s": prefill, "decode_s": decode,
                      "prefills_s": [s[0] for s in splits[name]], "decodes_s": [s[1] for s in splits[name]],
                      "time_s": common.median(times), "times_s": times, "first_s": first[name],
                      "tokens_per_s": B * N / common.median(times), "decode_tokens_per_s": B * (N - 1) / decode,
                      "step_s": step, **roof, "achieved_gbps": roof["bytes_per_step"] / step / 1e9,
                      "bandwidth_gbps": gbps, "roofline_fraction": roof["bytes_per_step"] / step / 1e9 / gbps,
                      "greedy_agrees": bool(torch.equal(tokens[name], tokens["kv-cache"]))}
        if grown[name] is not None:
            row["peak_bytes"] = roof["weight_bytes"] + grown[name]
            row["peak_growth_bytes"] = grown[name]
            row["peak_ratio"] = row["peak_bytes"] / (roof["weight_bytes"] + roof["cache_bytes"])
        rows.append(row)
    for name, why in missing.items():
        rows.append({"model": model_name, "impl": name, "dtype": dtype, "batch": B, "prompt": P, "new_tokens": N,
                     "status": "unavailable", "reason": why})
    ok = [r for r in rows if r["status"] == "ok"]
    log(f"{model_name} {dtype} batch {B} prompt {P} + {N}: " + ", ".join(
        f"{r['impl']} prefill {r['prefill_s'] * 1e3:.0f} ms, decode {r['decode_tokens_per_s']:.1f} tok/s, around it "
        f"{r['bandwidth_gbps']:.1f} GB/s" for r in ok))
    return rows


@torch.inference_mode()
def _no_cache_step(ours: GPT, seq: torch.Tensor) -> torch.Tensor:
    return ours(seq)[0][:, -1].argmax(dim=-1)  # (1,) greedy, from the whole sequence again


def _no_cache_row(ours: GPT, idx: torch.Tensor, settings: Settings, device, dtype: str) -> dict:
    """no-cache: one step at the midpoint of each of K equal slices of the N steps."""
    P, N = idx.shape[1], settings.new_tokens
    K = min(settings.no_cache_samples, N)
    gen = torch.Generator().manual_seed(P)
    full = torch.cat([idx, torch.randint(settings.vocab_size, (1, N), generator=gen).to(idx.device)], dim=1)
    _no_cache_step(ours, idx)  # warm-up
    lengths = [P + int((k + 0.5) * N / K) for k in range(K)]  # context length of each sampled step
    step_s = [common.timed(lambda L=L: _no_cache_step(ours, full[:, :L]), device)[0] for L in lengths]
    total = sum(step_s) * N / K
    return {"model": GPT2_MODEL, "impl": "no-cache", "dtype": dtype, "batch": 1, "prompt": P, "new_tokens": N,
            "status": "ok", "time_s": total, "times_s": step_s, "sampled_lengths": lengths, "tokens_per_s": N / total,
            "estimated": True}


def _ok(result: dict, **where) -> list[dict]:
    return [r for r in result["results"] if r["status"] == "ok" and all(r.get(k) == v for k, v in where.items())]


def _case(r: dict) -> tuple:
    return r["model"], r["dtype"], r["batch"], r["prompt"]


def _label(r: dict) -> str:
    return f"{r['dtype']} B={r['batch']} P={r['prompt']}"


def targets(result: dict) -> list[dict]:
    rows = _ok(result)
    by = {(_case(r), r["impl"]): r for r in rows}
    ckpt = (result.get("ckpt") or {}).get("name")
    hf_best = {}  # case -> the faster transformers row (decode) and the faster prefill
    for r in rows:
        if r["impl"] in HF_IMPLS:
            best = hf_best.setdefault(_case(r), {"decode": r, "prefill": r})
            if r["decode_tokens_per_s"] > best["decode"]["decode_tokens_per_s"]:
                best["decode"] = r
            if r["prefill_s"] < best["prefill"]["prefill_s"]:
                best["prefill"] = r
    ours = {}  # case -> our faster decode row, eager or compiled
    for r in rows:
        if r["impl"] in OURS and r["decode_tokens_per_s"] > ours.get(_case(r), {}).get("decode_tokens_per_s", 0.0):
            ours[_case(r)] = r
    ck = [c for c in ours if c[0] == ckpt and c in hf_best]
    dec = [(ours[c]["decode_tokens_per_s"] / hf_best[c]["decode"]["decode_tokens_per_s"], ours[c]) for c in ck]
    pre = [(hf_best[c]["prefill"]["prefill_s"] / ours[c]["prefill_s"], ours[c]) for c in ck]
    mem = [(r["peak_ratio"], r) for c, r in ours.items() if c[0] == ckpt and "peak_ratio" in r]
    roof = [(r["roofline_fraction"], r) for c, r in ours.items() if c[2] == 1 and "roofline_fraction" in r]
    gpt2 = [(ours[c]["decode_tokens_per_s"] / hf_best[c]["decode"]["decode_tokens_per_s"], ours[c]) for c in ours
            if c[0] == GPT2_MODEL and c[2] == 1 and c in hf_best]
    small = [(x, r) for x, r in dec if r["batch"] == 1]

    def listing(pairs, fmt="{:.2f}x"):
        return ", ".join(f"{fmt.format(x)} ({(r['model'] + ' ') if r['model'] != ckpt else ''}{_label(r)}"
                         f"{' compiled' if r['impl'] == 'compiled' else ''})" for x, r in pairs)

    def status(pairs, ok):
        return None if not pairs else all(ok(x) for x, _ in pairs)

    none = "not measured (no checkpoint rows with transformers in this run)"
    first = result["settings"]["dtypes"][0] if "settings" in result else "float32"
    old = [(by[(c, "kv-cache")]["tokens_per_s"] / by[(c, "hf-sdpa")]["tokens_per_s"], by[(c, "kv-cache")])
           for c in ours if c[0] == GPT2_MODEL and c[1] == first and c[2] == 1
           and {(c, "kv-cache"), (c, "hf-sdpa")} <= by.keys()]
    nc = [(by[(c, "kv-cache")]["tokens_per_s"] / r["tokens_per_s"], r) for r in rows if r["impl"] == "no-cache"
          for c in [_case(r)] if (c, "kv-cache") in by and r["prompt"] + r["new_tokens"] >= 1024]
    paths = [(c["compiled_path"], c) for c in result.get("checks", []) if "compiled_path" in c]
    return [
        common.target(f"{ckpt or 'checkpoint'}: our decode tokens/s >= the faster of transformers eager/SDPA, "
                      "every row", status(dec, lambda x: x >= 1.0), listing(dec) or none),
        common.target(f"{ckpt or 'checkpoint'}: our prefill at least as fast as the faster of transformers "
                      "eager/SDPA, every row", status(pre, lambda x: x >= 1.0), listing(pre) or none),
        common.target(f"{ckpt or 'checkpoint'}: our peak memory within 1.2x of weights + cache",
                      status(mem, lambda x: x <= 1.2), listing(mem) or "not measured"),
        common.target("batch-1 decode >= 0.85 of the measured streaming bandwidth (float32 and bfloat16)",
                      status(roof, lambda x: x >= 0.85),
                      (listing(roof, "{:.2f}") + " of the bandwidth measured around each row's runs")
                      if roof else "not measured"),
        common.target("GPT-2-small shape: batch-1 decode >= 1.3x transformers' generate",
                      status(gpt2, lambda x: x >= 1.3),
                      listing(gpt2) or "not measured"),
        common.target(f"{ckpt or 'checkpoint'}: batch-1 decode >= 2.5x the faster of transformers eager/SDPA",
                      status(small, lambda x: x >= 2.5), listing(small) or none),
        common.target("GPT-2-small shape: kv-cache >= 2x transformers' generate, prefill included (batch 1)",
                      status(old, lambda x: x >= 2.0), listing(old) or "not measured"),
        common.target("kv-cache decoding >= 10x no-cache at 1024 tokens of context", status(nc, lambda x: x >= 10.0),
                      listing(nc, "{:.1f}x") or "not measured (no context >= 1024 in this run)"),
        common.target("the one call compile_decode(model) decodes on the C++ kernel wherever the kernel serves the "
                      "model", status(paths, lambda x: True) and all((p == "kernel") == c["kernel_serves"]
                                                                     for p, c in paths),
                      ", ".join(f"{c['model']} {c['dtype']}: {p}" for p, c in paths) or "not measured"),
    ]


def report(result: dict) -> str:
    bw = result["bandwidth"]
    body = []
    for r in result["results"]:
        head = [r["model"], r["impl"], r["dtype"], str(r["batch"]), str(r["prompt"]), str(r["new_tokens"])]
        if r["status"] != "ok":
            body.append(head + ["n/a"] * 8 + [f"{r['status']}: {r['reason']}"])
        elif r["estimated"]:
            body.append(head + ["", "", f"{r['tokens_per_s']:.1f}", "", "", "", "", "", "estimated from sampled steps"])
        else:
            mem = (f"{r['peak_bytes'] / 2 ** 20:.0f}", f"{r['peak_ratio']:.2f}") if "peak_bytes" in r else ("", "")
            body.append(head + [f"{r['prefill_s'] * 1e3:.0f}", f"{r['decode_tokens_per_s']:.1f}",
                                f"{r['tokens_per_s']:.1f}", f"{r['achieved_gbps']:.3g}",
                                f"{r['bandwidth_gbps']:.3g}", f"{r['roofline_fraction']:.3g}", *mem,
                                "" if r["greedy_agrees"] else "greedy tokens differ from ours"])
    checks = "; ".join(f"{c['model']} {c['dtype']}: cached vs full {c['cache_err']:.1e}, "
                       f"compiled {c['compiled_err']:.1e}"
                       + (f", ours vs transformers {c['vs_hf_err']:.1e}" if "vs_hf_err" in c else "")
                       + (f", to float32 ours {c['vs_fp32_err']:.1e} transformers {c['hf_vs_fp32_err']:.1e}"
                          if "vs_fp32_err" in c else "")
                       for c in result["checks"])
    return "\n".join([
        "", f"decode: greedy; prefill ms, decode tok/s (all rows of the batch, after the first token), tok/s with "
            f"prefill; GB/s read per decode step (weights + KV cache), the bandwidth a sum streamed around the "
            f"row's runs and x that roofline (before and after the run, the best of sum, copy and matvec: "
            f"{bw['before']['gbps']:.1f} and {bw['after']['gbps']:.1f} GB/s); peak MiB (weights + resident growth) "
            f"and x (weights + cache)",
        common.table(["model", "impl", "dtype", "B", "prompt", "new", "prefill ms", "decode tok/s", "tok/s",
                      "GB/s", "roof GB/s", "x roof", "peak MiB", "x w+c", "note"], body),
        f"checks (relative logit error): {checks}", *_over_roofline(result), "",
        common.format_targets(result["targets"])])


def _over_roofline(result: dict) -> list[str]:
    """A warning line when a batch-1 row read faster than the roofline: a batch-1 step reads
    every weight once, so the bandwidth was measured while the machine was busier than then."""
    over = [r for r in _ok(result, batch=1) if r.get("roofline_fraction", 0.0) > 1.0]
    if not over:
        return []
    return [f"warning: {len(over)} batch-1 row(s) above the roofline (up to "
            f"{max(r['roofline_fraction'] for r in over):.2f}x): the bandwidth probes ran while this machine was "
            f"busier than those rows; rerun on a quiet machine"]


def plot(result: dict, path: Path) -> Path:
    rows = [r for r in _ok(result) if not r["estimated"]]
    cases = list(dict.fromkeys(_case(r) for r in rows))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig = _plot.figure(figsize=(max(8, 0.6 * len(cases) + 2), 4.5))
    ax = fig.subplots()
    width = 0.8 / max(len(impls), 1)
    for i, name in enumerate(impls):
        vals = [next((r["roofline_fraction"] for r in rows
                      if r["impl"] == name and _case(r) == c), 0.0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(cases))],
                  [f"{m}\n{d} B={b} P={p}" for m, d, b, p in cases], rotation=90, fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(ylabel="fraction of streaming bandwidth",
           title=f"python -m benchmarks decode ({result['machine']['device']})")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
