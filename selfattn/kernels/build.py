"""The C++ kernels compiled on first use, for the widest instruction set the CPU runs.

``matvec.cpp`` and ``decode.cpp`` (with their shared header ``matvec.h``) are compiled together into
one shared library with the machine's compiler (``$CXX`` or ``c++``; torch.compile needs one on the
CPU too), for an instruction set of :data:`~selfattn.kernels.features.FLAGS`, and kept in
:func:`selfattn._util.files.cache_dir` named by a hash of the sources, the flags and the torch version:
a later process (or a test worker) finds it there. A build that fails raises one line saying why;
:func:`selfattn.kernels.matvec.failure` turns that into the reason its callers keep PyTorch's
kernels.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from pathlib import Path

import torch
from torch.utils import cpp_extension

from selfattn._util import files as _files
from selfattn.kernels.features import FLAGS

HERE = Path(__file__).parent
SOURCES = (HERE / "matvec.cpp", HERE / "decode.cpp")  # one library: the ops of both register in one namespace
HEADERS = (HERE / "matvec.h",)
# OpenMP: ATen's parallel_for; no contraction: the kernels fuse where they mean to (matvec.h says why)
COMMON = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
TIMEOUT = 300  # seconds a build may take before it counts as failed


def namespace(isa: str) -> str:
    """The operators' namespace in ``torch.ops`` for the build of ``isa``."""
    return f"selfattn_matvec_{isa}"


def command(isa: str, output: Path) -> list[str]:
    """The compiler's command line that builds ``isa``'s library into ``output``."""
    torch_lib = Path(torch.__file__).parent / "lib"
    return [os.environ.get("CXX", "c++"), *COMMON, *FLAGS[isa], f"-DSELFATTN_NAMESPACE={namespace(isa)}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{HERE}",
            *(str(s) for s in SOURCES), "-o", str(output), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}"]


def library(isa: str) -> Path:
    """The shared library for ``isa``: from the cache when the same sources, flags and torch built
    it, else compiled into a temporary beside it and renamed, one process at a time (the others wait for it).
    Raises ``OSError``, ``RuntimeError`` or ``subprocess.SubprocessError`` (one line) when it cannot."""
    if isa not in FLAGS:
        raise ValueError(f"isa must be one of {', '.join(map(repr, FLAGS))}, got {isa!r}")
    sources = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + " ".join(command(isa, Path("OUT"))).encode() + torch.__version__.encode())
    built = _files.cache_dir() / "kernels" / f"matvec-{isa}-{key.hexdigest()[:16]}.so"
    if built.exists():
        return built
    built.parent.mkdir(parents=True, exist_ok=True)
    with open(built.with_name(f".{built.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent process building the same library: wait for its result
        if built.exists():
            return built
        tmp = built.with_name(f".{built.name}.tmp-{os.getpid()}")
        try:
            done = subprocess.run(command(isa, tmp), capture_output=True, text=True, timeout=TIMEOUT)
            if done.returncode != 0:
                errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines()[-1:]
                names = " and ".join(s.name for s in SOURCES)
                raise RuntimeError(f"compiling {names} for {isa} failed: {errors[0] if errors else done.returncode}")
            os.replace(tmp, built)
        finally:
            tmp.unlink(missing_ok=True)
    return built
