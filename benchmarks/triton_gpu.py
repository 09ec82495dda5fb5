"""``python -m benchmarks triton``: the Triton backend on a CUDA GPU, parity at real sizes, then speed.

1. Parity (the gate): forward and backward of the ``triton`` backend against the ``math``
   oracle at T up to 16384, D 64/80/128, bfloat16/float16/float32, causal, window, KV cache
   (S > T), GQA/MQA, key padding and documents, the built-in score rules (ALiBi, soft-capping,
   learned sinks), sink tokens and prefix-LM, by the FlashAttention rule
   (:func:`selfattn.audit.parity.flash_rule`): ``max|triton - exact| <= 2 max|math_same_dtype
   - exact| + floor``, where ``exact`` is the math backend in float32 for half inputs (float64
   for float32 inputs), with IEEE float32 matmuls (no TF32). The ``tiled`` backend's half tiles
   (multiplied in bf16/fp16 with float32 products) are checked the same way. A failing case
   stops the suite.
2. Speed: forward and forward+backward of the kernel against
   ``scaled_dot_product_attention`` restricted to its FlashAttention and its cuDNN backend,
   16k tokens per batch, MHA. TFLOP/s count only the (query, key) pairs the mask shows (the
   causal half); forward+backward counts 3.5x the forward (backward = 2.5x). The ratio is to
   the faster SDPA backend. No new benchmark starts after ``budget_s`` seconds.

About 5-8 minutes on one H200 (``--quick``: about one).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import common
from selfattn._util import plot as _plot
from selfattn.audit.parity import flash_rule, forward_backward
from selfattn.scores import alibi_slopes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FLOOR = {torch.bfloat16: 1e-4, torch.float16: 1e-5, torch.float32: 1e-6}

# (B, H, Hkv, T, S, D, dtype, mask options): every mask kind at a real size; memory for the
# float32 oracle stays under ~20 GiB (B * H * T * S * 4 bytes per score tensor).
PARITY = (
    (2, 8, 8, 1024, 1024, 64, "bf16", {"causal": False}),
    (1, 8, 2, 4096, 4096, 128, "fp16", {}),
    (1, 2, 1, 16384, 16384, 128, "bf16", {}),
    (1, 2, 2, 16384, 16384, 64, "fp16", {"window": 4096}),
    (1, 4, 4, 512, 8192, 128, "bf16", {}),  # a KV cache: bottom-right causal
    (4, 8, 1, 1, 16384, 128, "fp16", {}),  # decoding one token, MQA
    (2, 4, 4, 4096, 4096, 64, "bf16", {"padding": True, "docs": True}),  # rows that see nothing
    (1, 4, 2, 3000, 3000, 80, "bf16", {}),  # ragged T, head dim padded inside the kernel
    (1, 4, 4, 2048, 2048, 128, "fp32", {"window": 256}),
    (2, 8, 2, 4096, 4096, 128, "bf16", {"alibi": True, "softcap": 30.0, "sinks": True}),  # the score rules
    (2, 4, 4, 4096, 4096, 64, "fp16", {"prefix": True}),  # prefix-LM, a different prefix per row
    (1, 4, 4, 8192, 8192, 64, "bf16", {"window": 1024, "sink_tokens": 4}),  # StreamingLLM's sink tokens
)
# The tiled backend's half-precision tiles on a GPU (``bmm`` with float32 products), same format.
TILED_PARITY = (
    (2, 8, 2, 4096, 4096, 64, "bf16", {}),
    (2, 4, 4, 2048, 2048, 128, "fp16", {"window": 256, "padding": True, "docs": True}),
)


@dataclass
class Settings:
    parity: tuple = PARITY  # the parity cases of triton (see PARITY)
    tiled_parity: tuple = TILED_PARITY  # the parity cases of tiled's half tiles
    dtypes: tuple[str, ...] = ("bf16", "fp16")  # benchmark dtypes
    seq_lens: tuple[int, ...] = (1024, 4096, 16384)  # benchmark T
    head_dims: tuple[int, ...] = (64, 128)  # benchmark D
    tokens: int = 16384  # B·T of every benchmark
    width: int = 2048  # H·D of every benchmark: H = width / D query heads
    budget_s: float = 480.0  # start no new benchmark after this many seconds


FULL = Settings()
QUICK = Settings(parity=PARITY[:2] + PARITY[4:5], tiled_parity=TILED_PARITY[:1], dtypes=("bf16",),
                 seq_lens=(1024, 4096), head_dims=(128,))


def unavailable(device: torch.device) -> str | None:
    """Why the suite cannot run on ``device``: it needs a CUDA GPU and Triton."""
    if device.type != "cuda":
        return f"python -m benchmarks triton needs a CUDA GPU; the device is {device}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "python -m benchmarks triton needs Triton: pip install 'selfattn[triton]'"
    return None


def visible_pairs(T: int, S: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs a causal/window mask shows; query i sits at key position S - T + i."""
    if not causal and window is None:
        return T * S
    return sum(min(p + 1, window or p + 1) for p in range(S - T, S))


def attention_flops(B: int, H: int, T: int, S: int, D: int, causal: bool, backward: bool) -> int:
    """Two matmuls of 2·D flops per visible pair forward; the backward does 2.5x that."""
    forward = 4 * B * H * D * visible_pairs(T, S, causal)
    return int(forward * 3.5) if backward else forward


def masks_for(B: int, H: int, S: int, opts: dict, device) -> dict:
    """attention() keywords for a parity case: causal, window, left padding, three documents,
    and the built-in rules (ALiBi's slopes, a soft cap, sink logits, sink tokens, prefixes)."""
    kw = {"causal": opts.get("causal", True), "window": opts.get("window")}
    if opts.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(H).to(device)
    if opts.get("softcap"):
        kw["softcap"] = opts["softcap"]
    if opts.get("sinks"):
        kw["sinks"] = torch.linspace(-2.0, 2.0, H, device=device)
    if opts.get("sink_tokens"):
        kw["sink_tokens"] = opts["sink_tokens"]
    if opts.get("prefix"):
        kw["prefix_len"] = torch.linspace(0, S, B, device=device).long()  # (B,): from none to all
    if opts.get("padding"):
        kpm = torch.ones(B, S, dtype=torch.bool, device=device)
        kpm[0, : S // 8] = False  # left padding: the first queries of batch 0 see nothing
        kw["key_padding_mask"] = kpm
    if opts.get("docs"):
        kw["doc_ids"] = (torch.arange(S, device=device) * 3 // S).expand(B, S).contiguous()  # (B, S)
    return kw


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    why = unavailable(device)
    if why:
        raise ValueError(why)
    import triton

    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the oracle's float32 matmuls without TF32
    started = time.perf_counter()
    info = common.machine(device)
    log(common.describe(info))
    result = {"suite": "triton", "machine": info, "settings": asdict(settings), "triton": triton.__version__,
              "parity": [], "results": [], "not_run": []}
    for backend, case in [("triton", c) for c in settings.parity] + [("tiled", c) for c in settings.tiled_parity]:
        row = check_parity(case, device, backend)
        result["parity"].append(row)
        log(f"parity {'ok  ' if row['ok'] else 'FAIL'} {backend} {row['case']}  ({backend}/math err) "
            + " ".join(f"{p['name']} {p['error']:.1e}/{p['reference_error']:.1e}" for p in row["tensors"]))
        torch.cuda.empty_cache()
    failed = [(r["backend"], r["case"]) for r in result["parity"] if not r["ok"]]
    if failed:
        raise common.CorrectnessError(f"the FlashAttention rule is broken in {len(failed)} parity case(s), "
                                      f"first {failed[0]}")
    for dtype_name in settings.dtypes:
        for D in settings.head_dims:
            for causal in (True, False):
                for T in settings.seq_lens:
                    if time.perf_counter() - started > settings.budget_s:
                        result["not_run"].append({"T": T, "D": D, "causal": causal, "dtype": dtype_name,
                                                  "why": "time budget"})
                        continue
                    for row in bench_case(settings, T, D, causal, dtype_name, device):
                        result["results"].append(row)
                        log(describe(row))
                    torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def check_parity(case, device: torch.device, backend: str = "triton") -> dict:
    B, H, Hkv, T, S, D, dtype_name, opts = case
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(B, h, n, D, generator=g, device=device)
                     for h, n in ((H, T), (Hkv, S), (Hkv, S), (H, T)))  # (B, H|Hkv, T|S, D)
    mask = masks_for(B, H, S, opts, device)
    exact_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    started = time.perf_counter()
    got = forward_backward(backend, q, k, v, dout, dtype=dtype, **mask)
    common.sync(device)
    seconds = time.perf_counter() - started
    same = forward_backward("math", q, k, v, dout, dtype=dtype, **mask)
    torch.cuda.empty_cache()
    exact = forward_backward("math", q, k, v, dout, dtype=exact_dtype, **mask)
    rows = flash_rule(got, same, exact, floor=FLOOR[dtype])
    case_row = dict(B=B, H=H, Hkv=Hkv, T=T, S=S, D=D, dtype=dtype_name, **opts)
    return {"backend": backend, "case": case_row, "ok": all(p.ok for p in rows),
            "seconds_first_call": round(seconds, 3), "tensors": [p._asdict() | {"ok": p.ok} for p in rows]}


def bench_case(settings: Settings, T: int, D: int, causal: bool, dtype_name: str, device: torch.device) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from selfattn.backends import triton as triton_backend
    from selfattn.masks import Mask

    dtype = DTYPES[dtype_name]
    B, H = settings.tokens // T, settings.width // D
    q, k, v, dout = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(4))  # (B, H, T, D)
    for t in (q, k, v):
        t.requires_grad_()
    mask, scale = Mask(causal=causal), D ** -0.5

    def sdpa_with(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return fn

    impls = {"triton": lambda q, k, v: triton_backend.run(q, k, v, mask, scale=scale),
             "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION)}
    rows = []
    for backward in (False, True):
        flops = attention_flops(B, H, T, T, D, causal, backward)
        row = {"B": B, "H": H, "T": T, "D": D, "causal": causal, "dtype": dtype_name,
               "mode": "fwd+bwd" if backward else "fwd"}
        for name, fn in impls.items():
            try:
                ms = _bench_ms(fn, backward, q, k, v, dout)
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            except RuntimeError as e:  # e.g. a backend that does not take this shape
                row[name] = {"error": str(e).splitlines()[0][:200]}
        sdpa = [row[n]["tflops"] for n in ("sdpa_flash", "sdpa_cudnn") if "tflops" in row[n]]
        if sdpa and "tflops" in row["triton"]:
            row["ratio_to_best_sdpa"] = row["triton"]["tflops"] / max(sdpa)
        rows.append(row)
    return rows


def _bench_ms(fn, backward: bool, q, k, v, dout) -> float:
    from triton.testing import do_bench

    if not backward:
        return do_bench(lambda: fn(q, k, v), return_mode="median")
    return do_bench(lambda: fn(q, k, v).backward(dout), grad_to_none=[q, k, v], return_mode="median")


def describe(row: dict) -> str:
    kind = "causal" if row["causal"] else "full  "
    cells = [f"{row['mode']:7s} {row['dtype']} T={row['T']:5d} D={row['D']:3d} {kind}"]
    for name in ("triton", "sdpa_flash", "sdpa_cudnn"):
        cells.append(f"{name} {row[name]['tflops']:6.1f}" if "tflops" in row[name] else f"{name}   n/a ")
    cells.append(f"ratio {row['ratio_to_best_sdpa']:.2f}" if "ratio_to_best_sdpa" in row else "ratio n/a")
    return " | ".join(cells)


def report(result: dict) -> str:
    ratios = [r["ratio_to_best_sdpa"] for r in result["results"] if "ratio_to_best_sdpa" in r]
    lines = ["", f"parity: {sum(r['ok'] for r in result['parity'])}/{len(result['parity'])} cases ok",
             "TFLOP/s (visible pairs only) and triton / best SDPA:"]
    lines += ["  " + describe(r) for r in result["results"]]
    if ratios:
        lines.append(f"ratio to best SDPA: min {min(ratios):.2f}, max {max(ratios):.2f}")
    if result["not_run"]:
        lines.append(f"not run (time budget): {len(result['not_run'])} benchmark settings")
    target = None if not ratios else min(ratios) >= 0.9
    measured = "not measured" if not ratios else f"worst {min(ratios):.2f}x, best {max(ratios):.2f}x"
    return "\n".join(lines + ["", common.format_targets([common.target("triton >= 0.9x the best SDPA backend",
                                                                        target, measured)])])


def plot(result: dict, path: Path) -> Path:
    """TFLOP/s per T of each implementation, one panel per (dtype, D, causal, mode)."""
    rows = result["results"]
    panels = sorted({(r["dtype"], r["D"], r["causal"], r["mode"]) for r in rows}, key=str)
    fig = _plot.figure(figsize=(4.5 * max(len(panels), 1), 4))
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, (dt, D, causal, mode) in zip(axes, panels):
        sel = sorted((r for r in rows if (r["dtype"], r["D"], r["causal"], r["mode"]) == (dt, D, causal, mode)),
                     key=lambda r: r["T"])
        for name in ("triton", "sdpa_flash", "sdpa_cudnn"):
            pts = [(r["T"], r[name]["tflops"]) for r in sel if "tflops" in r[name]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", xlabel="T", ylabel="TFLOP/s", title=f"{dt} D={D} {'causal' if causal else 'full'} {mode}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
