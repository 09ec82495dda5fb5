"""The Triton backend on a CUDA GPU: parity at real sizes, then speed against SDPA.

    python benchmarks/triton_gpu.py --out triton_gpu.json   # about 5-8 minutes on one H200

1. Parity: forward and backward of the ``triton`` backend against the ``math`` oracle at
   T up to 16384, D 64/80/128, bfloat16/float16/float32, causal, window, KV cache (S > T),
   GQA/MQA, key padding and documents. The FlashAttention rule, tensor by tensor:
   ``max|triton - exact| <= 2 max|math_same_dtype - exact| + floor``, where ``exact`` is
   the math backend in float32 for half inputs (float64 for float32 inputs), with IEEE
   float32 matmuls (no TF32).
2. Speed: forward and forward+backward of the kernel against
   ``scaled_dot_product_attention`` restricted to its FlashAttention and its cuDNN backend,
   16k tokens per batch, MHA. TFLOP/s count only the (query, key) pairs the mask shows
   (the causal half); forward+backward counts 3.5x the forward (backward = 2.5x). The
   ratio is to the faster SDPA backend.

Writes every result to the JSON file as it goes (a run cut short keeps what it measured);
exit status 1 when a parity check fails, 2 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FLOOR = {torch.bfloat16: 1e-4, torch.float16: 1e-5, torch.float32: 1e-6}

# (B, H, Hkv, T, S, D, dtype, mask options): every mask kind at a real size; memory for the
# float32 oracle stays under ~20 GiB (B * H * T * S * 4 bytes per score tensor).
PARITY = [
    (2, 8, 8, 1024, 1024, 64, "bf16", {"causal": False}),
    (1, 8, 2, 4096, 4096, 128, "fp16", {}),
    (1, 2, 1, 16384, 16384, 128, "bf16", {}),
    (1, 2, 2, 16384, 16384, 64, "fp16", {"window": 4096}),
    (1, 4, 4, 512, 8192, 128, "bf16", {}),  # a KV cache: bottom-right causal
    (4, 8, 1, 1, 16384, 128, "fp16", {}),  # decoding one token, MQA
    (2, 4, 4, 4096, 4096, 64, "bf16", {"padding": True, "docs": True}),  # rows that see nothing
    (1, 4, 2, 3000, 3000, 80, "bf16", {}),  # ragged T, head dim padded inside the kernel
    (1, 4, 4, 2048, 2048, 128, "fp32", {"window": 256}),
]
BENCH_TOKENS = 16384
BENCH_T = (1024, 4096, 16384)
BENCH_D = (64, 128)
BENCH_WIDTH = 2048  # H = 2048 / D query heads


def visible_pairs(T: int, S: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs a causal/window mask shows; query i sits at key position S - T + i."""
    if not causal and window is None:
        return T * S
    return sum(min(p + 1, window or p + 1) for p in range(S - T, S))


def attention_flops(B: int, H: int, T: int, S: int, D: int, causal: bool, backward: bool) -> int:
    """Two matmuls of 2·D flops per visible pair forward; the backward does 2.5x that."""
    forward = 4 * B * H * D * visible_pairs(T, S, causal)
    return int(forward * 3.5) if backward else forward


def masks_for(B: int, S: int, opts: dict, device) -> dict:
    """attention() keywords for a parity case: causal, window, left padding, three documents."""
    kw = {"causal": opts.get("causal", True), "window": opts.get("window")}
    if opts.get("padding"):
        kpm = torch.ones(B, S, dtype=torch.bool, device=device)
        kpm[0, : S // 8] = False  # left padding: the first queries of batch 0 see nothing
        kw["key_padding_mask"] = kpm
    if opts.get("docs"):
        kw["doc_ids"] = (torch.arange(S, device=device) * 3 // S).expand(B, S).contiguous()  # (B, S)
    return kw


def forward_backward(backend, q, k, v, dout, dtype, mask):
    from selfattn import attention

    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, backend=backend, **mask)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return [t.detach() for t in (out, *grads)]


def check_parity(case) -> dict:
    B, H, Hkv, T, S, D, dtype_name, opts = case
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, h, n, D, generator=g, device="cuda")
                     for h, n in ((H, T), (Hkv, S), (Hkv, S), (H, T)))  # (B, H|Hkv, T|S, D)
    mask = masks_for(B, S, opts, "cuda")
    exact_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    started = time.perf_counter()
    got = forward_backward("triton", q, k, v, dout, dtype, mask)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    rows = {}
    for name, ref_dtype in (("same", dtype), ("exact", exact_dtype)):
        rows[name] = [t.to(exact_dtype) for t in forward_backward("math", q, k, v, dout, ref_dtype, mask)]
        torch.cuda.empty_cache()
    result = {"case": dict(B=B, H=H, Hkv=Hkv, T=T, S=S, D=D, dtype=dtype_name, **opts), "ok": True,
              "seconds_first_call": round(seconds, 3)}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        g_, s_, e_ = got[i].to(exact_dtype), rows["same"][i], rows["exact"][i]
        err, base = (g_ - e_).abs().max().item(), (s_ - e_).abs().max().item()
        finite = bool(torch.isfinite(g_).all())
        ok = finite and err <= 2 * base + FLOOR[dtype]
        result[name] = {"err": err, "math_same_dtype_err": base, "finite": finite, "ok": ok}
        result["ok"] &= ok
    return result


def bench_ms(fn, backward: bool, q, k, v, dout) -> float:
    from triton.testing import do_bench

    if not backward:
        return do_bench(lambda: fn(q, k, v), return_mode="median")
    return do_bench(lambda: fn(q, k, v).backward(dout), grad_to_none=[q, k, v], return_mode="median")


def bench_case(T: int, D: int, causal: bool, dtype_name: str) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from selfattn.backends import triton as triton_backend
    from selfattn.masks import Mask

    dtype = DTYPES[dtype_name]
    B, H = BENCH_TOKENS // T, BENCH_WIDTH // D
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(4))  # (B, H, T, D)
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
                ms = bench_ms(fn, backward, q, k, v, dout)
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            except RuntimeError as e:  # e.g. a backend that does not take this shape
                row[name] = {"error": str(e).splitlines()[0][:200]}
        sdpa = [row[n]["tflops"] for n in ("sdpa_flash", "sdpa_cudnn") if "tflops" in row[n]]
        if sdpa and "tflops" in row["triton"]:
            row["ratio_to_best_sdpa"] = row["triton"]["tflops"] / max(sdpa)
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    kind = "causal" if row["causal"] else "full  "
    cells = [f"{row['mode']:7s} {row['dtype']} T={row['T']:5d} D={row['D']:3d} {kind}"]
    for name in ("triton", "sdpa_flash", "sdpa_cudnn"):
        cells.append(f"{name} {row[name]['tflops']:6.1f}" if "tflops" in row[name] else f"{name}   n/a ")
    cells.append(f"ratio {row['ratio_to_best_sdpa']:.2f}" if "ratio_to_best_sdpa" in row else "ratio n/a")
    return " | ".join(cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("triton_gpu.json"), help="JSON results file")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new benchmark after this many seconds (default 480)")
    parser.add_argument("--dtypes", default="bf16,fp16", help="benchmark dtypes (default bf16,fp16)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/triton_gpu.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the oracle's float32 matmuls without TF32
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "parity": [], "bench": [], "not_run": []}

    def save():
        report["seconds"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(report, indent=1))

    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}")
    for case in PARITY:
        result = check_parity(case)
        report["parity"].append(result)
        save()
        errs = " ".join(f"{n} {result[n]['err']:.1e}/{result[n]['math_same_dtype_err']:.1e}"
                        for n in ("out", "dq", "dk", "dv"))
        print(f"parity {'ok  ' if result['ok'] else 'FAIL'} {result['case']}  (triton/math err) {errs}")
        torch.cuda.empty_cache()

    for dtype_name in args.dtypes.split(","):
        for D in BENCH_D:
            for causal in (True, False):
                for T in BENCH_T:
                    entry = {"T": T, "D": D, "causal": causal, "dtype": dtype_name}
                    if time.perf_counter() - started > args.budget_s:
                        report["not_run"].append({**entry, "why": "time budget"})
                        continue
                    for row in bench_case(T, D, causal, dtype_name):
                        report["bench"].append(row)
                        print(describe(row))
                    save()
                    torch.cuda.empty_cache()
    save()
    failed = [r["case"] for r in report["parity"] if not r["ok"]]
    ratios = [r["ratio_to_best_sdpa"] for r in report["bench"] if "ratio_to_best_sdpa" in r]
    if ratios:
        print(f"ratio to best SDPA: min {min(ratios):.2f}, max {max(ratios):.2f}")
    if report["not_run"]:
        print(f"not run (time budget): {len(report['not_run'])} benchmark settings")
    print(f"parity: {len(report['parity']) - len(failed)}/{len(report['parity'])} ok; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
