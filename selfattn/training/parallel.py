"""Training on many processes: joining the process group, wrapping the model, reducing values.

Under ``torchrun`` (``RANK``, ``LOCAL_RANK``, ... in the environment) the run joins a process
group, over NCCL on GPUs or gloo on the CPU; the model is replicated with DDP or sharded with
FSDP2 ``fully_shard``. With context parallelism over N ranks, ranks [d·N, (d+1)·N) read the
same batch rows and split each sequence among them (:func:`context_parallel`); DDP still spans
every rank. Without torchrun everything here is the identity of one process.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

from selfattn.distributed import SequenceShard
from selfattn.distributed.layout import multiple


def rank() -> int:
    """This process's rank, 0 outside a process group (rank 0 alone prints and writes)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launched() -> bool:
    """Whether torchrun started this process (its environment names a rank): it then runs on a process group."""
    return "RANK" in os.environ


def setup(device: torch.device, fsdp: bool, context_parallel: int = 1) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); joins the process group torchrun describes."""
    if not launched():
        if fsdp:
            raise ValueError("--fsdp shards the model across processes: launch with torchrun --nproc_per_node=N")
        if context_parallel > 1:
            raise ValueError(f"--context-parallel {context_parallel} splits each sequence across processes: launch "
                             f"with torchrun --nproc_per_node={context_parallel} (or a multiple of it)")
        return 0, 1, device
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def context_parallel(n: int, rank: int, world: int, block_size: int,
                     window: int | None) -> tuple[SequenceShard | None, int, int]:
    """(this rank's :class:`SequenceShard`, its data-parallel rank, the data-parallel world size)
    when each sequence is split over ``n`` ranks; (None, rank, world) for n = 1.

    Ranks [d·n, (d+1)·n) form the ring of batch rows d. The layout is zigzag (balanced causal
    work), or contiguous for a sliding window, whose ring then stops after one step."""
    if n == 1:
        return None, rank, world
    if world % n:
        raise ValueError(f"--context-parallel {n} needs a number of ranks that is a multiple of {n}, got {world}")
    layout = "contiguous" if window is not None else "zigzag"
    if block_size % multiple(layout, n):
        raise ValueError(f"--context-parallel {n} splits block_size={block_size} into {multiple(layout, n)} equal "
                         f"chunks ({layout} layout): use a block_size that is a multiple of {multiple(layout, n)}")
    rings = [dist.new_group(list(range(d * n, (d + 1) * n))) for d in range(world // n)]  # every rank makes each
    return SequenceShard(block_size, rings[rank // n], layout), rank // n, world // n


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(raw: nn.Module, *, compile: bool, fsdp: bool, world: int, device: torch.device) -> nn.Module:
    """The model as the training step calls it: compiled, sharded (FSDP2) or replicated (DDP)."""
    model = torch.compile(raw) if compile else raw
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in raw.blocks:
            fully_shard(block)
        fully_shard(raw)  # the root: embeddings (tied to the head), final norm
        return model
    if world > 1:
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP and ``torch.compile`` wrappers (FSDP2 shards in place, no wrapper)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    return model


def grad_sync(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-step (DDP ``no_sync``, FSDP2's switch)."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not sync:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, clip: float) -> float:
    """Clip the global gradient norm to ``clip`` (0 = no clipping) and return the norm before."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2 returns a DTensor


def mean_over_ranks(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(value)  # SUM: gloo has no AVG
        value = value / world
    return value
