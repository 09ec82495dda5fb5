"""``selfattn serve`` as a command: a process serving a trained run (BPE tokens) on a free port, which
SIGTERM or Ctrl-C stops after the request in flight has been answered, exiting 0; its errors are one
line and status 2."""
import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from selfattn.cli import main
from selfattn.io.loading import load
from selfattn.serve import server
from selfattn.serve.app import create_app
from selfattn.serve.engine import Engine

from helpers.serving import WAIT


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A micro model trained for two steps on the built-in corpus with a BPE tokenizer."""
    out = tmp_path_factory.mktemp("serve") / "run"
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "64",
                 "--batch-size", "4", "--max-steps", "2", "--eval-every", "2", "--set", "eval_batches=1",
                 "--save-every", "2", "--tokenizer", "bpe", "--set", "bpe_vocab=300", "--out", str(out)]) == 0
    return out


def _first_line(proc: subprocess.Popen) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], WAIT)
    assert ready, "the server printed nothing"
    return proc.stdout.readline()


@pytest.mark.slow  # make check leaves it out: a server process each
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_lets_the_request_in_flight_finish_and_exits_0(run, stop):
    proc = subprocess.Popen([sys.executable, "-m", "selfattn", "serve", "--ckpt", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(proc)
        assert line.startswith("selfattn serve: run on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" on ")[1].split("/v1")[0]
        body = {"prompt": "The ", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT) as response:
            lines = response.iter_lines()
            first = next(lines)
            proc.send_signal(stop)  # while the answer is in flight
            rest = [line for line in lines if line]
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(WAIT) == 0
        assert proc.stdout.read().splitlines()[-1] == "selfattn serve: stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _burst(url: str, faults: bool) -> None:
    """32 requests at once, a third of them streamed; with ``faults``, among them malformed ones, 10 MB
    bodies and clients that leave mid-stream."""
    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": "The " * (1 + i % 7), "max_tokens": 24, "temperature": 0, "stream": i % 3 == 0}
        if faults and i % 8 == 1:
            await http.post("/v1/completions", content=b"{oops")
        elif faults and i % 8 == 3:
            await http.post("/v1/completions", content=b"x" * 10_000_000)
        elif faults and i % 8 == 5:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for _ in response.aiter_lines():
                    break  # the client leaves after the first event
        else:
            assert (await http.post("/v1/completions", json=body)).status_code in (200, 503)

    async def all_at_once():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=WAIT, limits=limits) as http:
            await asyncio.gather(*[one(http, i) for i in range(32)])

    asyncio.run(all_at_once())


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_after_a_barrage_of_faults_the_server_answers_and_its_memory_is_back_near_idle(run):
    proc = subprocess.Popen([sys.executable, "-m", "selfattn", "serve", "--ckpt", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(proc)
        url = line.split(" on ")[1].split("/v1")[0]
        for _ in range(2):  # warm: the allocator's pools and the decode path as serving leaves them
            _burst(url, faults=False)
        idle = _rss_kib(proc.pid)
        for _ in range(3):
            _burst(url, faults=True)
        for _ in range(int(WAIT * 10)):  # bounded: until every row is freed
            if httpx.get(url + "/health", timeout=WAIT).json()["rows"] == 0:
                break
            time.sleep(0.1)
        answer = httpx.post(url + "/v1/completions", json={"prompt": "The ", "max_tokens": 4, "temperature": 0},
                            timeout=WAIT).json()
        assert answer["usage"]["completion_tokens"] == 4
        after = _rss_kib(proc.pid)
        assert after <= 1.1 * idle, f"resident memory {after} KiB after the faults, {idle} KiB idle before them"
    finally:
        proc.kill()
        proc.wait(WAIT)


def test_a_run_with_no_chat_template_answers_a_chat_with_an_error_naming_it(run):
    loaded = load(run)
    app = create_app(loaded, Engine(loaded.model), name="run")  # never started: the error comes before the engine
    transport = httpx.ASGITransport(app=app)

    async def ask():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})

    response = asyncio.run(ask())
    assert response.status_code == 400
    assert "has no chat template; use /v1/completions" in response.json()["error"]["message"]


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "nowhere"], "'nowhere' does not exist"),
    (["--max-batch", "0"], "--max-batch must be in 1..16, got 0"),
    (["--queue", "-1"], "--queue must be >= 0, got -1"),
    (["--port", "70000"], "port must be in 0..65535, got 70000"),
    (["--api-key", ""], "--api-key needs a key"),
])
def test_errors_are_one_line_and_status_2(run, capsys, args, message):
    args = ["--ckpt", str(run), *args] if args[0] != "--ckpt" else args
    assert main(["serve", "--port", "0", *args]) == 2  # a later --port wins
    err = capsys.readouterr().err
    assert err.startswith("selfattn serve: error: ") and message in err and err.count("\n") == 1


def test_a_client_that_connects_while_the_model_loads_waits_instead_of_being_refused():
    sock = server.listen("127.0.0.1", 0)  # what serve holds from before loading until uvicorn runs
    bound = socket.socket()  # the negative control: bound, not listening
    bound.bind(("127.0.0.1", 0))
    try:
        with socket.create_connection(sock.getsockname(), timeout=WAIT):
            pass  # queued in the backlog: uvicorn accepts it once it runs
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(bound.getsockname(), timeout=WAIT)
    finally:
        sock.close()
        bound.close()


def test_a_port_in_use_is_an_error_before_the_model_loads(capsys):
    taken = server.listen("127.0.0.1", 0)
    try:
        assert main(["serve", "--ckpt", "nowhere", "--port", str(taken.getsockname()[1])]) == 2
    finally:
        taken.close()
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
