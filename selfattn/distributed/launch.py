"""Run a function on P local processes joined in one gloo process group (tests, benchmarks, experiments).

``run_local(fn, world, *args)`` spawns ``world`` processes; each joins the group over TCP on
127.0.0.1 (one torch thread each, so P processes share the cores evenly; with
``backend="nccl"`` rank r takes GPU r), calls
``fn(rank, world, *args)`` and returns its result, which comes back pickled. The group has a
timeout: a rank left waiting for a message that never comes fails instead of hanging. ``fn``
must be importable by name (a module-level function), as ``spawn`` re-imports it.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_local(fn: Callable, world: int, *args, timeout_s: float = 60.0, backend: str = "gloo") -> list:
    """Every rank's ``fn(rank, world, *args)``, in rank order; an exception on any rank is raised here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world, port, timeout_s, tmp, fn, args, backend), nprocs=world,
                           start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _rank_main(rank: int, world: int, port: int, timeout_s: float, tmp: str, fn: Callable, args: tuple,
               backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        dist.barrier()  # no rank leaves while another may still be sending to it
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
