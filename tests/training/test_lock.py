"""The run folder's lock: a second holder is refused naming the first, a dead holder's lock is
taken over, holds nest, and a folder made for nothing is removed."""
import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from selfattn.training import lock

# Holds the run folder argv[1] and waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from selfattn.training import lock

with lock.hold(sys.argv[1]):
    Path(sys.argv[2]).touch()
    time.sleep(600)
"""


def _is_locked(path) -> bool:
    """Whether another open file description holds an exclusive flock on ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / "run"``: (its Popen, the run folder)."""
    run, ready = tmp_path / "run", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        yield proc, run
    finally:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_naming_the_first(holder):
    proc, run = holder
    with pytest.raises(lock.RunFolderInUse) as e:
        with lock.hold(run):
            pytest.fail("the lock was taken twice")
    assert str(e.value).startswith(f"run folder {run} is in use by PID {proc.pid} (it holds {run / '.lock'})")
    assert "\n" not in str(e.value)


def test_a_killed_holders_lock_is_taken_over(holder):
    proc, run = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / ".lock").read_text().split()[0] == str(proc.pid)  # the dead holder's file is still there
    with lock.hold(run):
        assert (run / ".lock").read_text().split()[0] == str(os.getpid())
        assert _is_locked(run / ".lock")
    assert not (run / ".lock").exists()


def test_holds_nest_and_release_at_the_outermost(tmp_path):
    run = tmp_path / "run"
    with lock.hold(run):
        (run / "log.jsonl").write_text("")
        with lock.hold(run):  # train() inside the command that already holds the folder
            assert _is_locked(run / ".lock")
        assert _is_locked(run / ".lock")
    assert not (run / ".lock").exists() and (run / "log.jsonl").exists()


def test_a_folder_made_for_nothing_is_removed_and_a_used_one_kept(tmp_path):
    with pytest.raises(ValueError, match="refused"):
        with lock.hold(tmp_path / "fresh"):
            raise ValueError("refused before anything was written")
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "old").mkdir()
    with lock.hold(tmp_path / "old"):
        pass
    assert (tmp_path / "old").is_dir()  # it was there before: kept, even empty


def test_only_rank_0_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with lock.hold(tmp_path / "run"):
        assert not (tmp_path / "run" / ".lock").exists()


def test_the_lock_checker_can_fail(tmp_path):  # negative control
    path = tmp_path / "file"
    path.write_text("")
    assert not _is_locked(path)
