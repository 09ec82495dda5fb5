"""Fault injection: nothing lost, nothing trusted blindly.

A run SIGKILLed again and again (inside a save, inside the token cache, in the middle of a
step, while a second process knocks on its run folder), resumed each time by a fresh process,
ends exactly where an uninterrupted run does. A full disk, during the token cache and during a
save, is one line naming the file, leaves no temporary and the last good checkpoint intact.
An edited checkpoint header is refused by every command.
"""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from selfattn.cli import main
from selfattn.training import checkpoint
from selfattn.training.data import read_corpus

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count in every process
RUN = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
       "--grad-accum", "2", "--warmup-steps", "2", "--set", "eval_batches=2", "--max-steps", "8", "--save-every", "2",
       "--eval-every", "4", "--dropout", "0.1", "--set", "keep=2"]

# `selfattn train ARGS` with one fault: at the n-th call of _files.fsync on a file whose name
# matches GLOB (inside an atomic write: the token cache, the log, a checkpoint...) or of
# data.batch (inside a training step or an evaluation), the process SIGKILLs itself, or with
# FAULT_HOLD=path announces itself in that file and waits to be killed.
FAULTY = """
import fnmatch, os, signal, sys, time
from pathlib import Path
from selfattn._util import files as _files
from selfattn.cli import main
from selfattn.training import data

where, pattern, n = os.environ["FAULT_AT"].split(":")
module, name = (_files, "fsync") if where == "fsync" else (data, "batch")
real, calls = getattr(module, name), [0]

def faulty(*args, **kwargs):
    if where == "batch" or fnmatch.fnmatch(Path(args[0]).name, pattern):
        calls[0] += 1
        if calls[0] == int(n):
            if os.environ.get("FAULT_HOLD"):
                Path(os.environ["FAULT_HOLD"]).write_text(str(os.getpid()))
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

setattr(module, name, faulty)
sys.exit(main(sys.argv[1:]))
"""


def _selfattn(*args, fault=None, hold=None, wait=True):
    cmd = [sys.executable, "-c", FAULTY] if fault else [sys.executable, "-m", "selfattn"]
    env = {**ENV, "FAULT_AT": fault or "", "FAULT_HOLD": str(hold or "")}
    proc = subprocess.Popen(cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _records(run):
    """The log's records without timings."""
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
            for line in (run / "log.jsonl").read_text().splitlines()]


def _temporaries(folder):
    """Ours (``.name.tmp-<pid>``) and the safetensors writer's (``.tmpXXXXXX``)."""
    return sorted(p.name for p in Path(folder).rglob(".*tmp*"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(read_corpus(None)[0][:20_000])
    return path


@pytest.fixture(scope="module")
def whole(tmp_path_factory, corpus):
    """The run, uninterrupted."""
    run = tmp_path_factory.mktemp("whole") / "run"
    r = _selfattn("train", *RUN, "--data", str(corpus), "--out", str(run))
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_killed_at_random_moments_and_resumed_it_ends_as_the_uninterrupted_run(whole, corpus, tmp_path):
    run, rng = tmp_path / "run", random.Random(15)
    start = ["train", *RUN, "--data", str(corpus), "--out", str(run)]

    def again(**fault):  # resume when there is a checkpoint to resume from, else start over
        return _selfattn(*(["train", "--resume", "--out", str(run)] if checkpoint.latest(run) else start), **fault)

    r = again(fault=f"fsync:*:{rng.randint(1, 6)}")  # inside the token cache (three files, two fsyncs each)
    assert r.returncode == -9 and checkpoint.latest(run) is None, r.stderr
    r = again(fault=f"fsync:.ckpt-*:{rng.randint(1, 3)}")  # inside a checkpoint save, before its rename
    assert r.returncode == -9, r.stderr
    assert [n for n in _temporaries(run) if n.startswith(".ckpt-")], "the kill did not hit a save"

    hold = tmp_path / "holding"
    proc = again(fault=f"batch::{rng.randint(1, 8)}", hold=hold, wait=False)  # in the middle of a step
    try:
        deadline = time.monotonic() + 120
        while not hold.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                ended = proc.poll() is not None
                pytest.fail(f"the run did not reach its fault: {proc.stderr.read() if ended else 'timed out'}")
            time.sleep(0.05)
        second = again()  # a second process on the same run folder while the first one trains
    finally:
        proc.kill()  # SIGKILL, in the middle of a step
        proc.communicate()
    assert second.returncode == 2
    assert second.stderr.splitlines() == [f"selfattn train: error: run folder {run} is in use by PID {proc.pid} "
                                          f"(it holds {run / '.lock'}); wait for it to finish or stop it, or train "
                                          f"in another --out"]
    assert (run / ".lock").read_text().split()[0] == str(proc.pid)  # a stale lock: its holder is dead

    r = again()  # takes the stale lock over and trains to the end
    assert r.returncode == 0 and "selfattn train: done, step 8" in r.stdout, r.stderr
    # every loss, lr, gradient norm and val loss, bit for bit (test_train's negative control shows that another
    # seed gives other losses, so this equality is not vacuous)
    assert _records(run) == _records(whole)
    a, _ = checkpoint.read_weights(whole / "ckpt-0000008.safetensors")
    b, _ = checkpoint.read_weights(run / "ckpt-0000008.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _temporaries(run) == [] and not (run / ".lock").exists()


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.slow  # make check leaves it out: every command in turn
def test_an_edited_header_is_refused_by_every_command(whole, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    newest = run / "ckpt-0000008.safetensors"
    raw = newest.read_bytes()
    newest.write_bytes(raw.replace(b'\\"step\\": 8', b'\\"step\\": 9', 1))  # one digit, same length
    assert newest.read_bytes() != raw
    best = run / "best.safetensors"  # a folder means its best: edited too, it is refused naming itself
    step = checkpoint.load(best)["step"]  # one digit: the run has 8 steps
    best.write_bytes(best.read_bytes().replace(f'\\"step\\": {step}'.encode(), f'\\"step\\": {step + 1}'.encode(), 1))
    assert main(["sample", "--ckpt", str(run)]) == 2
    assert f"checkpoint {best} is corrupted (SHA-256" in capsys.readouterr().err
    best.unlink()  # and without it, the folder means its newest
    before = {p: _sha(p) for p in run.rglob("*") if p.is_file()}
    for command in (["sample", "--ckpt", str(run)], ["sample", "--ckpt", str(newest)],
                    ["train", "--resume", "--out", str(run)], ["check", "--ckpt", str(run)]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"checkpoint {newest} is corrupted (SHA-256" in err, err
        given_the_folder = str(newest) not in command
        assert given_the_folder == ("the older ckpt-0000006.safetensors (step 6) is intact" in err), err
    assert {p: _sha(p) for p in run.rglob("*") if p.is_file()} == before  # nothing was written


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at tmp_path / "disk", unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"selfattn-test-{uuid.uuid4().hex[:8]}",
                           str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a full disk is simulated with a small tmpfs, and mounting one needs root: "
                    f"{done.stderr.strip() or done.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _fill(disk, leave):
    """Fill ``disk`` until ``leave`` bytes are free."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (free - leave))
    return disk / "filler"


def test_a_full_disk_during_the_token_cache_is_one_line(small_disk, tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text((read_corpus(None)[0] * 3)[:1_200_000])  # more bytes than the disk holds
    run = small_disk / "run"
    assert main(["train", *RUN, "--data", str(big), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    full = "selfattn train: error: no space left on the device writing"
    assert err.startswith(f"{full} {run / 'tokens' / 'train.bin'} (") and " free in " in err, err
    assert _temporaries(small_disk) == [] and not (run / "tokens" / "meta.json").exists()
    assert not (run / ".lock").exists()


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(small_disk, corpus, capsys):
    run = small_disk / "run"
    assert main(["train", *RUN, "--max-steps", "2", "--data", str(corpus), "--out", str(run)]) == 0
    last = run / "ckpt-0000002.safetensors"
    digest = _sha(last)
    filler = _fill(small_disk, leave=24 * 1024)  # room for log lines, not for a checkpoint
    capsys.readouterr()
    assert main(["train", "--resume", "--max-steps", "6", "--eval-every", "100", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the closed progress bar
    assert err.startswith(f"selfattn train: error: no space left on the device writing {checkpoint.path_for(run, 4)} (")
    assert _temporaries(small_disk) == [] and checkpoint.latest(run) == last and _sha(last) == digest
    filler.unlink()  # room again: the run continues from the checkpoint the full disk left intact
    assert main(["train", "--resume", "--max-steps", "6", "--eval-every", "100", "--out", str(run)]) == 0
    assert [r["step"] for r in _records(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_cuts_an_appended_log_back(small_disk):
    from selfattn._util import files as _files

    log = small_disk / "log.jsonl"
    log.write_text('{"step": 1}\n')
    _fill(small_disk, leave=0)
    with pytest.raises(_files.DiskFull) as e:
        _files.append_text(log, '{"step": 2, "note": "' + "x" * 20_000 + '"}\n')
    assert str(e.value).startswith(f"no space left on the device writing {log} (0 bytes free in {small_disk})")
    assert log.read_text() == '{"step": 1}\n'  # not half a line
