"""Benchmarks against the peers, in one run: attention T sweep, decode tokens/s, train tokens/s.

``python -m benchmarks attention|decode|speculative|int8|train|finetune|surgery|interp|serving|loading|decode-llama|
masks|context-parallel|triton|all [--out DIR] [--quick] [--device D] [--threads N]``, from the repository's root,
runs the suites of :mod:`benchmarks` (``auto``'s calibration is the library's own command, ``selfattn calibrate``). Each
prints its tables
and targets and writes ``DIR/<suite>.json`` and ``DIR/<suite>.png``; a failed correctness check
stops the run with exit status 1. ``--quick`` runs small shapes in about a minute. ``all`` runs
every suite, adding ``triton`` on a CUDA device; ``decode --speculative`` adds the speculative
suite to the decode run, so that the roofline's rows and the speculative ones come from one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import benchmarks as suites
from benchmarks import common
from selfattn._util import files as _files
from selfattn._util import validate as _validate

PROG = "python -m benchmarks"

HELP = {"attention": "attention layers: our backends vs the peers over a T sweep",
        "decode": "prefill and decode speed, memory roofline and peak memory: ours vs transformers' generate",
        "speculative": "speculative decoding on a real model: prompt lookup and self-speculation vs plain and "
                       "transformers' generate (with its prompt lookup), a chat answer and an edit",
        "int8": "weight-only int8 vs the float model: perplexity, top-1 agreement, decode time per token",
        "train": "training-step tokens/s: our GPT vs a nanoGPT-equivalent model",
        "finetune": "a fine-tuning step on SmolLM2, full and LoRA, float32 and bfloat16: ours vs transformers + peft",
        "surgery": "SmolLM2 given a sliding window with sink tokens: perplexity before, after, after a fine-tune; "
                   "decode speed and KV cache at a long context",
        "interp": "selfattn.interp vs TransformerLens on SmolLM2: a plain forward, run_with_cache of every site and "
                  "of three, a head sweep of activation patching",
        "serving": "selfattn serve vs llama.cpp's llama-server under 1, 4 and 16 streaming chat clients: aggregate "
                   "tokens/s, time to first token, inter-token latency",
        "loading": "SmolLM2's and Gemma 3's GGUF files loaded and ready to generate: ours vs llama.cpp",
        "decode-llama": "batch-1 decode and prefill tokens/s on SmolLM2 and Gemma 3 in float32, bfloat16 and int8: "
                        "ours vs llama.cpp's llama-bench on the files requantised to F32, BF16 and Q8_0",
        "masks": "windows, documents, padding: every backend and auto's choice vs dense SDPA and FlexAttention",
        "context-parallel": "ring attention over N local processes vs one: memory per rank, bytes sent, balance",
        "triton": "the Triton kernel on a CUDA GPU: parity at real sizes, TFLOP/s vs SDPA flash and cuDNN",
        "all": "every suite, one after the other (triton only on a CUDA device)"}


def run(argv: list[str] | None = None) -> int:
    """``python -m benchmarks``: parse, run, and the exit status; a mistake a user can fix (a bad flag
    or value, a file in the way) is one line and status 2, as the ``selfattn`` commands do."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:  # the suite's usage line, not the top-level one
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return main(args)
    except (ValueError, TypeError, OSError) as e:
        if os.environ.get("SELFATTN_DEBUG"):
            raise
        print(f"{PROG} {args.suite}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.suite}: interrupted", file=sys.stderr)
        return 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, help_text in HELP.items():
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.add_argument("--out", default="bench_results",
                       help="directory for <suite>.json and <suite>.png (default: bench_results)")
        s.add_argument("--quick", action="store_true", help="small shapes, about a minute")
        s.add_argument("--device", default="auto", help="cpu, cuda, ... (default auto: the accelerator if any)")
        s.add_argument("--threads", type=int, default=None, help="torch threads (default: every core available)")
        if name != "triton":
            s.add_argument("--reps", type=int, default=None, help="timed repetitions (default: the suite's)")
        SUITE_FLAGS.get(name, lambda s: None)(s)
        s.set_defaults(_parser=s)  # an unknown flag shows this suite's usage


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the benchmarks never download anything
    device = _validate.device(args.device)
    out = _files.writable_folder(args.out)  # checked before the work, so no result is lost at the end
    common.pin_threads(args.threads)
    names = [args.suite] if args.suite != "all" else [n for n in suites.SUITES
                                                      if n not in suites.GPU_ONLY or device.type == "cuda"]
    added = ["speculative"] if getattr(args, "speculative", False) else []  # decode --speculative, its own settings
    for name in names + added:
        suite = suites.SUITES[name]
        settings = _defaults(name, args) if name in added else _settings(name, args)
        print(f"== {PROG} {name}" + (" (quick)" if args.quick else ""), flush=True)
        try:
            result = suite.run(settings, device, log=lambda line: print(line, flush=True))
        except common.CorrectnessError as e:
            print(f"{PROG} {name}: FAILED the correctness check, nothing timed is reported: {e}",
                  file=sys.stderr)
            return 1
        print(suite.report(result))
        written = [common.write_json(out, name, result)]
        try:
            written.append(suite.plot(result, out / f"{name}.png"))
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
        print("wrote " + ", ".join(map(str, written)), flush=True)
    return 0


def _defaults(name: str, args: argparse.Namespace):
    """The suite's FULL settings, or QUICK with ``--quick``."""
    return suites.SUITES[name].QUICK if args.quick else suites.SUITES[name].FULL


def _settings(name: str, args: argparse.Namespace):
    """The suite's FULL or QUICK settings with the fields its flags set (flags left unset change nothing)."""
    base = _defaults(name, args)
    fields = {f.name for f in dataclasses.fields(base)}
    given = {key: value for key, value in vars(args).items() if key in fields and value is not None}
    given = {key: tuple(value) if isinstance(value, list) else value for key, value in given.items()}
    if getattr(args, "no_memory", False):
        given["memory"] = False
    if getattr(args, "no_ckpt", False):
        given["ckpt"] = None
    return dataclasses.replace(base, **given)


def _attention_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.attention.FULL, suites.attention.QUICK
    p.add_argument("--dtypes", "--dtype", nargs="+", choices=tuple(common.DTYPES), default=None,
                   help="dtypes (default: float32, and bfloat16 where the hardware supports it)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help=f"the T sweep, each dividing --tokens (default {full.seq_lens}, --quick {quick.seq_lens})")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"B·T, fixed across the sweep (default {full.tokens}, --quick {quick.tokens})")
    p.add_argument("--n-embd", type=int, default=None, help=f"width C (default {full.n_embd}, --quick {quick.n_embd})")
    p.add_argument("--n-head", type=int, default=None,
                   help=f"heads H, head dim C / H (default {full.n_head}, --quick {quick.n_head})")
    p.add_argument("--impls", nargs="+", choices=suites.attention.IMPLS, default=None,
                   help="implementations to run (default: all)")
    p.add_argument("--max-mem-gib", type=float, default=None,
                   help="skip configurations estimated to need more (default: 90%% of free accelerator memory, "
                        "50%% of available RAM)")
    p.add_argument("--max-call-s", type=float, default=None,
                   help=f"skip an implementation once its predicted time per call exceeds this "
                        f"(default {full.max_call_s:g}, --quick {quick.max_call_s:g})")
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")


def _decode_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.decode.FULL, suites.decode.QUICK
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens to generate after each prompt (default {full.new_tokens}, --quick {quick.new_tokens})")
    p.add_argument("--prompts", type=int, nargs="+", default=None,
                   help=f"GPT-2-shape prompt lengths (default {full.prompts}, --quick {quick.prompts})")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help=f"batch sizes (default {full.batches}, --quick {quick.batches})")
    p.add_argument("--dtypes", "--dtype", nargs="+", choices=tuple(common.DTYPES), default=None,
                   help=f"weight and cache dtypes (default {' '.join(full.dtypes)})")
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="a model to bench beside the GPT-2 shape: any path selfattn loads (run folder, checkpoint, "
                        "transformers folder, GGUF file); default: SmolLM2-135M-Instruct's GGUF file in "
                        ".cache/models (`make models`), none with --quick")
    p.add_argument("--no-ckpt", action="store_true", help="the GPT-2 shape only")
    p.add_argument("--ckpt-prompt", type=int, default=None,
                   help=f"prompt length of the --ckpt rows (default {full.ckpt_prompt}, --quick {quick.ckpt_prompt})")
    p.add_argument("--ckpt-new-tokens", type=int, default=None,
                   help=f"tokens generated in the --ckpt rows (default {full.ckpt_new_tokens}, "
                        f"--quick {quick.ckpt_new_tokens})")
    p.add_argument("--bandwidth-mib", type=int, default=None,
                   help=f"size of the streaming-bandwidth test (default {full.bandwidth_mib}, "
                        f"--quick {quick.bandwidth_mib})")
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    p.add_argument("--speculative", action="store_true",
                   help="the speculative suite's rows in this run too, with its own settings (`python -m benchmarks "
                        "speculative`, --quick's where given), written to speculative.json beside decode.json")


def _speculative_flags(p: argparse.ArgumentParser) -> None:
    full = suites.speculative.FULL
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model (with a tokenizer and a chat template); default: SmolLM2-135M-Instruct's GGUF "
                        "file in .cache/models (`make models`); --quick: a small random model")
    p.add_argument("--workloads", nargs="+", choices=tuple(suites.speculative.WORKLOADS), default=None,
                   help="which prompts (default: all)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens to generate at most, each row stopping at the end of its answer (default "
                        f"{full.new_tokens})")
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help=f"default {full.dtype}")
    p.add_argument("--self-layers", type=int, default=None,
                   help="N of self:N, the blocks that draft (default: a quarter of the model's)")


def _int8_flags(p: argparse.ArgumentParser) -> None:
    full = suites.quantized.FULL
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model (with a tokenizer); default: SmolLM2-135M-Instruct's GGUF file in .cache/models "
                        "(`make models`); --quick: a small random model")
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help=f"default {full.dtype}")
    p.add_argument("--new-tokens", type=int, default=None, help=f"decoded tokens timed (default {full.new_tokens})")


def _train_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.train.FULL, suites.train.QUICK
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"rows per training step (default {full.batch_size}, --quick {quick.batch_size})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per row (default {full.seq_len}, --quick {quick.seq_len})")


def _finetune_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.finetune.FULL, suites.finetune.QUICK
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model; default: SmolLM2-135M-Instruct's GGUF file in .cache/models (`make models`); "
                        "--quick: a small random model")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"rows per step (default {full.batch_size}, --quick {quick.batch_size})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per row (default {full.seq_len}, --quick {quick.seq_len})")
    p.add_argument("--rank", type=int, default=None, help=f"LoRA's rank (default {full.rank}, --quick {quick.rank})")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=None,
                   help="float32 and/or bfloat16 autocast (default: both)")
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")


def _surgery_flags(p: argparse.ArgumentParser) -> None:
    full = suites.surgery.FULL
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model; default: SmolLM2-135M-Instruct's GGUF file in .cache/models (`make models`); "
                        "--quick: a small random model")
    p.add_argument("--tuned", default=None, metavar="RUN",
                   help="a fine-tuned run of the changed model (train --init-from MODEL --set window=W "
                        "--set sink_tokens=S): its perplexity too")
    p.add_argument("--window", type=int, default=None, help=f"the sliding window (default {full.window})")
    p.add_argument("--sink-tokens", type=int, default=None, help=f"sink tokens (default {full.sink_tokens})")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens of an evaluation window and of the decode's prompt (default {full.context})")


def _interp_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.interp.FULL, suites.interp.QUICK
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model (with a tokenizer; TransformerLens gets it exported as a transformers folder); "
                        "default: SmolLM2-135M-Instruct's GGUF file in .cache/models (`make models`); --quick: a "
                        "small random model")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens of the forward and cache rows (default {full.tokens}, --quick {quick.tokens})")
    p.add_argument("--sweep-reps", type=int, default=None,
                   help=f"timed head sweeps of each (default {full.sweep_reps}, --quick {quick.sweep_reps})")
    p.add_argument("--no-memory", action="store_true", help="do not measure peak memory")


def _serving_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.serving.FULL, suites.serving.QUICK
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="the model both serve (llama-server: GGUF files only); default: SmolLM2-135M-Instruct's GGUF "
                        "file in .cache/models (`make models`); --quick: a small random model, ours alone")
    p.add_argument("--clients", type=int, nargs="+", default=None,
                   help=f"counts of concurrent clients, each sending --reps requests in turn (default {full.clients}, "
                        f"--reps {full.reps}; --quick {quick.clients}, --reps {quick.reps})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens per answer (default {full.max_tokens}, --quick {quick.max_tokens})")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"our server's --max-batch (default {full.max_batch}, --quick {quick.max_batch})")


def _loading_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=tuple(suites.loading.FILES), default=None,
                   help="the GGUF files to load (default: both; --quick: SmolLM2 alone)")


def _decode_llama_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.decode_llama.FULL, suites.decode_llama.QUICK
    p.add_argument("--models", nargs="+", choices=tuple(suites.decode_llama.MODELS), default=None,
                   help=f"the GGUF files (default: {' '.join(full.models)}; --quick: {' '.join(quick.models)})")
    p.add_argument("--dtypes", "--dtype", nargs="+", choices=tuple(suites.decode_llama.LLAMA_TYPES), default=None,
                   help="ours in these dtypes, llama.cpp on the file requantised to F32, BF16 and Q8_0 respectively "
                        f"(default: {' '.join(full.dtypes)}; --quick: {' '.join(quick.dtypes)})")
    p.add_argument("--prompt", type=int, default=None,
                   help=f"prefill tokens, llama-bench -p (default {full.prompt}, --quick {quick.prompt})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"decoded tokens, llama-bench -n (default {full.new_tokens}, --quick {quick.new_tokens})")
    p.add_argument("--check-tokens", type=int, default=None,
                   help=f"greedy tokens ours and llama.cpp must agree on before timing, 0 for none (default "
                        f"{full.check_tokens})")


def _masks_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", nargs="+", type=_cell, default=None, metavar="MASK:T",
                   help=f"cells to run, e.g. docs-16:16384 (masks: {', '.join(suites.masks.MASKS)}; default: all at "
                        f"T = 4096 and 16384)")
    p.add_argument("--impls", nargs="+", choices=suites.masks.IMPLS, default=None,
                   help="implementations (default: all)")
    p.add_argument("--dtypes", "--dtype", nargs="+", choices=tuple(common.DTYPES), default=None,
                   help="dtypes (default: float32, and bfloat16 where the hardware supports it)")
    p.add_argument("--max-call-s", type=float, default=None,
                   help="skip an implementation whose first call took longer "
                        f"(default {suites.masks.FULL.max_call_s:g})")


def _cell(text: str) -> tuple[str, int]:
    name, _, T = text.partition(":")
    if name not in suites.masks.MASKS or not T.isdigit():
        raise argparse.ArgumentTypeError(f"expected MASK:T with MASK in {suites.masks.MASKS}, got {text!r}")
    return name, int(T)


def _context_parallel_flags(p: argparse.ArgumentParser) -> None:
    full, quick = suites.context_parallel.FULL, suites.context_parallel.QUICK
    p.add_argument("--nproc", dest="nprocs", type=int, nargs="+", default=None,
                   help=f"processes in the ring, one run each (default {full.nprocs}, --quick {quick.nprocs})")
    p.add_argument("--seq-len", dest="T", type=int, default=None,
                   help=f"positions of the whole sequence (default {full.T}, --quick {quick.T})")
    p.add_argument("--layouts", nargs="+", choices=("zigzag", "contiguous"), default=None,
                   help="layouts (default: both)")


def _triton_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new benchmark after this many seconds (default 480)")
    p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16", "fp32"), default=None,
                   help="benchmark dtypes (default bf16 fp16)")


SUITE_FLAGS = {"attention": _attention_flags, "decode": _decode_flags, "speculative": _speculative_flags,
               "int8": _int8_flags,
               "train": _train_flags, "finetune": _finetune_flags, "surgery": _surgery_flags, "interp": _interp_flags,
               "serving": _serving_flags,
               "loading": _loading_flags, "decode-llama": _decode_llama_flags,
               "masks": _masks_flags, "context-parallel": _context_parallel_flags, "triton": _triton_flags}
