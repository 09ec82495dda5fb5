"""``torch.compile`` for a function called with many shapes or many models.

torch.compile keeps the graphs it compiles for a function on the function's code object and
counts them there against its recompile limit (8); past it, it silently runs the function
eagerly. :func:`compile_own` compiles a copy of a function with a code object of its own, so
each matrix shape or each model gets its own limit, and one cannot push another out.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch


def compile_own(fn: Callable, name: str, **options) -> Callable:
    """``torch.compile(fn, **options)`` of a copy of ``fn`` whose code object is its own, named ``name``."""
    code = fn.__code__.replace(co_name=name)
    return torch.compile(types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__), **options)
