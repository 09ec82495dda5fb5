"""``python -m benchmarks serving``: an OpenAI-compatible server under concurrent clients, ``selfattn serve``
against llama.cpp's ``llama-server``.

Both serve the same GGUF file (SmolLM2-135M-Instruct, :data:`benchmarks.decode.DEFAULT_CKPT`) with the same
threads N (this process's torch threads, ``--threads``): ``llama-server -t N`` with its default parallel slots
(the count it reports at ``/props`` is kept with the result), ours ``selfattn serve --max-batch 16`` (rows
decoded together; its default is 8) with ``OMP_NUM_THREADS=N``. Each runs as a subprocess on 127.0.0.1 on a
free port, is polled on ``/health`` until it answers 200 (at most ``start_s``), and is stopped with SIGTERM,
then SIGKILL, whatever happens. Both stay up for the whole run; an idle server computes nothing.

Load: for each count of concurrent clients (1, 4, 16), each client, a thread opening a connection per request, sends
``reps`` chat requests one after the other, client i's j-th asking :data:`PROMPTS` [(i + j) mod 5], five
prompts from a few words to a few hundred tokens (``reps`` 5: every client asks each once, the same mix at
every count), greedy, ``max_tokens`` 128, streamed with ``stream_options.include_usage``. llama-server's
prompt cache is off (``cache_prompt`` false): the same prompts come back, and ours has none. The servers
take turns at each count, the order rotated from one count to the next. Every request has a deadline
(``request_s``). Per count and server:

- aggregate tokens/s: the completion tokens of every request (as the usage reports them) over the wall time
  from the first request sent to the last answer read;
- time to first token (TTFT): from sending a request to its first chunk with text, median and p95 over the
  requests;
- inter-token latency (ITL): the gaps between successive chunks with text (a chunk is a token, or a few
  where one token's bytes end no character), median and p95 over all the gaps.

Before anything is timed each server answers every prompt once, greedy, not streamed (its warm-up: a fresh
server's first requests run slower): ours must answer each as ``generate`` does on the loaded model alone
(what ``selfattn sample --chat TEXT --temperature 0`` prints), token for token; llama-server with some text
(it computes on the file's Q4_1 blocks, we on the dequantised float32 weights: the same model, not the same
numbers). Without a llama-server (:func:`benchmarks.llama_cpp.program`, ``make llama-cpp``) or a GGUF file,
ours runs alone and the report says why llama-server's rows are missing. ``--quick``: a small random model
written to a temporary run folder, ours alone, 1 and 2 clients.

Targets (the serving issue): ours at the most clients at least 1.2x ours at one client in aggregate tokens/s;
ours at least llama-server's aggregate tokens/s at every count of clients.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from benchmarks import common, llama_cpp
from benchmarks.decode import DEFAULT_CKPT
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.generation import decode_layout, generate
from selfattn.generation.layout import FEW
from selfattn.io.loading import Loaded, load, special_of
from selfattn.model import GPT
from selfattn.tokenizers import ByteTokenizer
from selfattn.tokenizers.chat import ChatTemplate
from selfattn.training import checkpoint

OURS, LLAMA = "selfattn serve", "llama-server"
SCALING = 1.2  # the target: ours at the most clients over ours at one client, aggregate tokens/s
STOP_S = 15.0  # seconds a server has to exit after SIGTERM before it is killed
TEXT = ("The lighthouse at the end of the harbour was built of grey granite cut from the hills above the town. "
        "For two centuries its keepers climbed the hundred and twelve steps every evening to trim the wick, wind "
        "the clockwork that turned the lens, and write the weather into a leather book. The light could be seen "
        "twenty miles out to sea on a clear night, and fishermen said they steered by it even when they could "
        "not see it, because they knew where it ought to be. When the light was automated, the last keeper "
        "moved into a cottage by the quay, from which he watched the beam sweep across the water each night. "
        "He kept writing the weather into his book until the day he died, though nobody asked him to. ")
PROMPTS = ("What is 2+2?",
           "Name three colours of the rainbow and say what each one makes you think of.",
           "Explain in a few sentences what a cache is, why computers use one, and what happens when the data it "
           "holds goes stale.",
           TEXT + "\n\nSummarise the text above in two sentences.",
           TEXT * 3 + "\n\nWrite a short poem inspired by the text above.")
TINY_CHAT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}>{% endif %}")  # the chat template of --quick's random model


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the GGUF file both serve; None: a small random model, ours alone
    clients: tuple[int, ...] = (1, 4, 16)  # counts of concurrent clients, one load each
    reps: int = len(PROMPTS)  # requests each client sends, one after the other (5: every prompt once)
    max_tokens: int = 128  # the most tokens an answer may take (it may end sooner)
    max_batch: int = FEW  # our --max-batch
    start_s: float = 180.0  # seconds a server may take to answer /health (ours may first build its C++ kernel)
    request_s: float = 300.0  # seconds a request may take

    def check(self) -> None:
        _validate.positive_ints(reps=self.reps, max_tokens=self.max_tokens, max_batch=self.max_batch)
        if not self.clients or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.clients):
            raise ValueError(f"clients must be positive ints, got {list(self.clients)}")
        if self.max_batch > FEW:
            raise ValueError(f"max_batch must be in 1..{FEW} (selfattn serve's --max-batch), got {self.max_batch}")
        _validate.positive_number("start_s", self.start_s)
        _validate.positive_number("request_s", self.request_s)


FULL = Settings()
QUICK = Settings(ckpt=None, clients=(1, 2), reps=2, max_tokens=8, max_batch=4, request_s=30.0)


@dataclass
class Server:
    """A server up on ``url``; ``body``: what every request to it adds; ``info``: what it says of itself."""
    name: str
    url: str
    body: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _launched(name: str, argv: list[str], port: int, start_s: float, env: dict | None = None):
    """Run ``argv`` (a server listening on ``port``) until the block ends; yields its :class:`Server` once
    ``/health`` answers 200. An OSError with the end of its output if it exits or stays silent first."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            _wait_healthy(proc, url, start_s, lambda: _tail(out))
            yield Server(name, url)
        finally:
            proc.terminate()
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_S)


def _wait_healthy(proc: subprocess.Popen, url: str, start_s: float, output: Callable[[], str]) -> None:
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise OSError(f"{proc.args[0]} exited with status {proc.returncode}: {output()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                return
        time.sleep(0.2)
    raise OSError(f"{proc.args[0]} did not answer {url}/health within {start_s:g} s: {output()}")


def _tail(out) -> str:
    """The last lines a server wrote."""
    out.seek(0)
    return " | ".join(out.read().decode(errors="replace").strip().splitlines()[-3:]) or "(no output)"


def _ours(stack: contextlib.ExitStack, path: str, settings: Settings, device: torch.device, threads: int) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "selfattn", "serve", "--ckpt", path, "--port", str(port),
            "--max-batch", str(settings.max_batch), "--device", str(device)]
    server = stack.enter_context(_launched(OURS, argv, port, settings.start_s,
                                           {**os.environ, "OMP_NUM_THREADS": str(threads)}))
    server.info = {"max_batch": settings.max_batch, "threads": threads}
    return server


def _llama(stack: contextlib.ExitStack, binary: Path, path: str, settings: Settings, threads: int) -> Server:
    port = _free_port()
    argv = [str(binary), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    server = stack.enter_context(_launched(LLAMA, argv, port, settings.start_s))
    server.body = {"cache_prompt": False}
    props = httpx.get(server.url + "/props", timeout=30.0).json()
    server.info = {"slots": props.get("total_slots"), "build": props.get("build_info"), "threads": threads}
    return server


def _peer(stack: contextlib.ExitStack, path: str, settings: Settings, threads: int) -> tuple[Server | None, str | None]:
    """llama-server up on ``path``, or None and why not (no GGUF file, no binary, it did not start)."""
    if Path(path).suffix != ".gguf":
        return None, "llama-server reads a GGUF file; this run's model is not one"
    binary, why = llama_cpp.program("llama-server")
    if binary is None:
        return None, why
    try:
        return _llama(stack, binary, path, settings, threads), None
    except OSError as e:
        return None, str(e)


def _tiny_run(folder: Path) -> str:
    """A small random Llama-shaped model reading bytes, with a chat template, saved as a run in ``folder``."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=4096, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos="rope",
                       norm="rmsnorm", mlp_kind="swiglu", intermediate_size=128, bias=False, tie_embeddings=True)
    model, tokenizer = GPT(config), ByteTokenizer()
    special = special_of(Loaded(model, tokenizer, None, folder, chat=ChatTemplate(TINY_CHAT, {}, "tiny")))
    meta = {"model": asdict(config), "tokenizer": tokenizer.spec(), "special": special}
    checkpoint.save(folder, 0, model, torch.optim.AdamW(model.parameters()), meta=meta, keep=1)
    return str(folder)


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _solo(model: GPT, loaded: Loaded, prompt: str, max_tokens: int, device: torch.device) -> str:
    """The greedy answer of ``model`` alone, as ``selfattn sample --chat PROMPT --temperature 0`` prints it."""
    ids = loaded.tokenizer.encode(loaded.require_chat().render(_chat(prompt)))
    tokens = []
    for token in generate(model, torch.tensor([ids], device=device), max_tokens, temperature=0):
        if int(token) in loaded.eos:
            break
        tokens.append(int(token))
    return loaded.tokenizer.decode(tokens)


def _answer(server: Server, prompt: str, max_tokens: int, request_s: float) -> str:
    body = {"model": "bench", "messages": _chat(prompt), "temperature": 0, "max_tokens": max_tokens, **server.body}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=request_s)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _check(servers: list[Server], loaded: Loaded, settings: Settings, device: torch.device) -> dict:
    """Every server answers every prompt once, greedy, before anything is timed (its warm-up too): ours as the
    model does alone, llama-server with some text. Returns the answers of each server."""
    answers = {s.name: [_answer(s, p, settings.max_tokens, settings.request_s) for p in PROMPTS] for s in servers}
    model = decode_layout(loaded.model.to(device).eval())  # the layout `selfattn sample` decodes with
    for prompt, ours in zip(PROMPTS, answers[OURS]):
        alone = _solo(model, loaded, prompt, settings.max_tokens, device)
        if ours != alone:
            raise common.CorrectnessError(f"serving: our server answered {ours!r} to {prompt[:40]!r}, the model "
                                          f"alone {alone!r}")
    empty = [prompt for prompt, theirs in zip(PROMPTS, answers.get(LLAMA, [])) if not theirs.strip()]
    if empty:
        raise common.CorrectnessError(f"serving: llama-server answered no text to {empty[0][:40]!r}")
    return answers


def _streamed_chat(client: httpx.Client, server: Server, prompt: str, settings: Settings) -> dict:
    """One streamed chat: its completion tokens, TTFT and the gaps between its chunks with text, in seconds."""
    body = {"model": "bench", "messages": _chat(prompt), "temperature": 0, "max_tokens": settings.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **server.body}
    start = time.perf_counter()
    deadline = start + settings.request_s
    times, usage = [], None
    with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{server.name}: a request took over {settings.request_s:g} s")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage is None or not times:
        raise ValueError(f"{server.name}: a streamed answer came without {'usage' if times else 'text'}")
    return {"tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"], "ttft": times[0] - start,
            "gaps": [b - a for a, b in zip(times, times[1:])]}


def _client(server: Server, index: int, settings: Settings) -> list[dict]:
    """Client ``index``'s requests, one after the other."""
    fresh = httpx.Limits(max_keepalive_connections=0)  # a connection per request: llama-server may close idle ones
    with httpx.Client(timeout=settings.request_s, limits=fresh) as client:
        return [_streamed_chat(client, server, PROMPTS[(index + j) % len(PROMPTS)], settings)
                for j in range(settings.reps)]


def _load(server: Server, clients: int, settings: Settings) -> dict:
    """``clients`` clients at once against ``server``: one row of the result."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [f.result() for f in [pool.submit(_client, server, i, settings) for i in range(clients)]]
    wall = time.perf_counter() - start
    requests = [r for answers in done for r in answers]
    tokens = sum(r["tokens"] for r in requests)
    ttft, itl = _spread([r["ttft"] for r in requests]), _spread([g for r in requests for g in r["gaps"]])
    return {"server": server.name, "clients": clients, "requests": len(requests),
            "prompt_tokens": sum(r["prompt_tokens"] for r in requests), "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": ttft[0], "ttft_p95_s": ttft[1], "itl_median_s": itl[0],
            "itl_p95_s": itl[1]}


def _spread(xs: list[float]) -> tuple[float | None, float | None]:
    """(median, 95th percentile) of ``xs``; None where there is none."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (None, None)
    return statistics.median(xs), statistics.quantiles(xs, n=20, method="inclusive")[18]


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        path = settings.ckpt or _tiny_run(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny")
        if not Path(path).exists():
            raise ValueError(f"{path} is missing" + (": run `make models`" if path == DEFAULT_CKPT else ""))
        loaded = load(path)
        servers = [_ours(stack, path, settings, device, threads)]
        peer, missing = _peer(stack, path, settings, threads)
        servers += [peer] if peer else []
        log(f"model: {path}; " + "; ".join(f"{s.name} {s.info}" for s in servers)
            + (f"; llama-server rows missing: {missing}" if missing else ""))
        check = _check(servers, loaded, settings, device)
        del loaded
        rows = []
        for i, clients in enumerate(settings.clients):
            for server in servers[i % len(servers):] + servers[:i % len(servers)]:
                rows.append(_load(server, clients, settings))
                log(_line(rows[-1]))
        health = httpx.get(servers[0].url + "/health", timeout=30.0).json()
    return {"suite": "serving", "machine": info, "settings": asdict(settings), "model": path, "threads": threads,
            "servers": {s.name: s.info for s in servers}, "ours_most_rows": health.get("most_rows"),
            "llama_missing": missing, "check": check, "results": rows, "targets": _targets(rows, missing)}


def _line(row: dict) -> str:
    return (f"{row['server']} {row['clients']} client(s): {row['tokens_per_s']:.1f} tok/s, TTFT median "
            f"{_ms(row['ttft_median_s'])} ms, ITL median {_ms(row['itl_median_s'])} ms")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _by_clients(rows: list[dict], server: str) -> dict[int, dict]:
    return {r["clients"]: r for r in rows if r["server"] == server}


def _targets(rows: list[dict], missing: str | None) -> list[dict]:
    ours, theirs = _by_clients(rows, OURS), _by_clients(rows, LLAMA)
    one, most = min(ours), max(ours)
    targets = []
    if most > one:
        scale = ours[most]["tokens_per_s"] / ours[one]["tokens_per_s"]
        targets.append(common.target(f"ours at {most} clients: aggregate tokens/s at least {SCALING}x ours at {one}",
                                     scale >= SCALING, f"{scale:.2f}x ({ours[most]['tokens_per_s']:.1f} vs "
                                                       f"{ours[one]['tokens_per_s']:.1f} tok/s)"))
    for clients, row in ours.items():
        what = f"{clients} client(s): ours at least llama-server's aggregate tokens/s"
        if clients not in theirs:
            targets.append(common.target(what, None, f"llama-server not run ({missing})"))
            continue
        ratio = row["tokens_per_s"] / theirs[clients]["tokens_per_s"]
        targets.append(common.target(what, ratio >= 1, f"{ratio:.2f}x ({row['tokens_per_s']:.1f} vs "
                                                       f"{theirs[clients]['tokens_per_s']:.1f} tok/s)"))
    return targets


def report(result: dict) -> str:
    s = result["settings"]
    rows = sorted(result["results"], key=lambda r: (r["server"] != OURS, r["clients"]))
    body = [[r["server"], r["clients"], r["requests"], r["prompt_tokens"], r["completion_tokens"], f"{r['wall_s']:.1f}",
             f"{r['tokens_per_s']:.1f}", _ms(r["ttft_median_s"]), _ms(r["ttft_p95_s"]), _ms(r["itl_median_s"]),
             _ms(r["itl_p95_s"])] for r in rows]
    servers = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in info.items())
                        for name, info in result["servers"].items())
    missing = [f"llama-server's rows are missing: {result['llama_missing']}"] if result["llama_missing"] else []
    return "\n".join([
        "", f"serving: {result['model']}; {s['reps']} streamed greedy chats per client, max_tokens {s['max_tokens']}; "
            f"{servers}; ours decoded up to {result['ours_most_rows']} rows together",
        common.table(["server", "clients", "requests", "prompt tokens", "tokens", "wall s", "tok/s", "TTFT p50 ms",
                      "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"], body),
        *missing, f"check (and warm-up): {' and '.join(result['check'])} answered each of the {len(PROMPTS)} prompts "
                  f"once; ours as the model alone does, token for token",
        common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    fig = _plot.figure(figsize=(12, 4))
    axes = fig.subplots(1, 3)
    panels = (("tokens_per_s", None, "aggregate tokens/s", 1), ("ttft_median_s", "ttft_p95_s", "TTFT (ms)", 1000),
              ("itl_median_s", "itl_p95_s", "ITL (ms)", 1000))
    for ax, (key, p95, label, scale) in zip(axes, panels):
        for server, color in ((OURS, "C0"), (LLAMA, "C1")):
            rows = sorted(_by_clients(result["results"], server).items())
            if not rows:
                continue
            clients = [c for c, _ in rows]
            ax.plot(clients, [_scaled(r[key], scale) for _, r in rows], "o-", color=color,
                    label=f"{server} median" if p95 else server)
            if p95:
                ax.plot(clients, [_scaled(r[p95], scale) for _, r in rows], "s--", color=color, label=f"{server} p95")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["settings"]["clients"], [str(c) for c in result["settings"]["clients"]])
        ax.set(xlabel="concurrent clients", ylabel=label)
        ax.legend(fontsize=7)
    fig.suptitle(f"python -m benchmarks serving ({result['machine']['device']}, {result['threads']} threads)")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)


def _scaled(value: float | None, scale: float) -> float:
    """A measure to draw (NaN, a gap in the line, where there is none)."""
    return math.nan if value is None else value * scale
