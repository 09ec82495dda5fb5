"""What a test needs from outside the clone, and the marks that say so.

The parts (:data:`PARTS`), each a mark:

- ``models``: the real GGUF models, SmolLM2-135M-Instruct and Gemma 3 270M (``make models``);
- ``llama_cpp``: llama.cpp's programs and source, the GGUF tests' oracles (``make llama-cpp``);
- ``browser``: the system Chromium the page tests drive (``make test`` installs it).

A test marked with any of them is marked ``external`` too. ``make check`` runs the tests that are not
(``pytest -m "not external"``); ``make test`` runs every test, and one whose part is missing fails (never
skips), saying what is missing and which ``make`` target provides it.

The marks come by themselves (``tests/conftest.py``): a test is marked with what the helpers it calls need
(those decorated ``@needs(...)``: ``smollm2()``, ``gemma3()``, ``llama_cpp.program()``, ``chromium()``, ...),
called directly, through its fixtures or through any function of ``tests/`` (:func:`reached`). A test that
reaches a part another way (a benchmark suite that loads the models, a command run in a subprocess) carries
the mark itself, ``@pytest.mark.models``. While the tests run, every file opened and every program started is
watched (:func:`watch`): a test that used a part without its mark fails, naming the mark, so the marks stay
true and ``make check`` never depends on a part.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from pathlib import Path

from benchmarks import assets, llama_cpp

CHROMIUM = "/usr/bin/chromium"
PARTS = {  # mark -> (what it is, what provides it)
    "models": ("the real GGUF models (SmolLM2-135M-Instruct, Gemma 3 270M)",
               "run `make models` (a prerequisite of `make test`), which fetches them into ~/.cache/selfattn/models"),
    "llama_cpp": ("llama.cpp's programs and source",
                  "run `make llama-cpp` (a prerequisite of `make test`), which builds them into "
                  "~/.cache/selfattn/llama.cpp"),
    "browser": ("the system Chromium", "`make test` installs Debian's chromium package (apt-get install chromium)"),
}
EXTERNAL = "external"
TESTS = str(Path(__file__).resolve().parents[1]) + os.sep  # the functions whose calls are followed


def needs(*parts: str):
    """Marks a helper as needing ``parts``: every test that calls it, however indirectly, is marked with them."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}: the parts are {', '.join(PARTS)}")

    def mark(function):
        function.__needs__ = frozenset(parts)
        return function
    return mark


def missing(part: str) -> str | None:
    """Why ``part`` is not here, or None when it is."""
    if part == "models":
        absent = [str(m.path) for m in assets.MODELS.values() if not m.path.is_file()]
        return f"{', '.join(absent)} missing" if absent else None
    if part == "llama_cpp":
        why = next((why for name in assets.LLAMA_TOOLS for path, why in [llama_cpp.program(name)] if path is None),
                   None)
        return why or (None if assets.LLAMA_CPP_SRC.is_dir() else f"no llama.cpp source in {assets.LLAMA_CPP_SRC}")
    if part == "browser":
        return None if os.path.exists(CHROMIUM) else f"{CHROMIUM} is missing"
    return None


def message(part: str, why: str) -> str:
    what, fix = PARTS[part]
    return f"this test needs {what} (mark {part!r}): {why}; {fix}. `make check` runs the tests that need none"


# ---- which parts a test reaches through the code it calls ----------------------------------------------------

def _names(code: types.CodeType) -> set[str]:
    """Every global or attribute name ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _ours(obj) -> bool:
    """Whether ``obj`` (a function, class or module) is defined in ``tests/``."""
    if isinstance(obj, types.FunctionType):
        return obj.__code__.co_filename.startswith(TESTS)
    module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(getattr(obj, "__module__", None) or "")
    return (getattr(module, "__file__", None) or "").startswith(TESTS)


@functools.cache
def reached(function) -> frozenset[str]:
    """The parts that ``function`` needs: those of the ``@needs`` helpers it calls, directly or through the
    functions and classes of ``tests/`` it uses (their globals, the attributes it names of the modules of
    ``tests/`` it uses, its closure), followed transitively."""
    found, seen, stack = set(), set(), [function]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (types.FunctionType, type)):
            found |= getattr(obj, "__needs__", frozenset())
        if isinstance(obj, types.FunctionType):
            obj = inspect.unwrap(obj)  # a decorated function's own code
            found |= getattr(obj, "__needs__", frozenset())
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            stack.append(obj.func)
            continue
        if isinstance(obj, type):
            if _ours(obj):
                stack.extend(v for v in vars(obj).values() if isinstance(v, (types.FunctionType, staticmethod,
                                                                              classmethod, property)))
            continue
        if isinstance(obj, (staticmethod, classmethod)):
            stack.append(obj.__func__)
            continue
        if isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset) if f is not None)
            continue
        if not isinstance(obj, types.FunctionType) or not _ours(obj):
            continue
        names, scope = _names(obj.__code__), obj.__globals__
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        for value in [scope.get(n) for n in names] + cells:
            if isinstance(value, types.ModuleType):
                if _ours(value):
                    stack.extend(a for n in names if isinstance(a := getattr(value, n, None), (types.FunctionType,
                                                                                               type)))
            elif isinstance(value, (types.FunctionType, type, functools.partial)):
                stack.append(value)
    return frozenset(found)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # not yet assigned
        return False
    return True


def of(item) -> set[str]:
    """The parts the test ``item`` needs: its marks among :data:`PARTS`, and what its function, its fixtures'
    functions and the functions among its parameters reach."""
    found = {m.name for m in item.iter_markers() if m.name in PARTS}
    roots = [getattr(item, "obj", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        roots += [d.func for d in defs]
    callspec = getattr(item, "callspec", None)
    roots += list(callspec.params.values()) if callspec is not None else []
    for root in roots:
        if isinstance(root, (types.FunctionType, types.MethodType, functools.partial)):
            found |= reached(getattr(root, "__func__", root))
    return found


# ---- which parts a test used while it ran ----------------------------------------------------------------

USED: dict[str, str] = {}  # part -> the first path or command that used it, since the last clear


def _watched() -> list[tuple[str, str]]:
    """(path prefix, part): the places that are a part's."""
    places = [(assets.HOME / "models", "models"), (assets.LINKS / "models", "models"),
              (assets.HOME / "llama.cpp", "llama_cpp"), (assets.LINKS / "llama.cpp", "llama_cpp"),
              (CHROMIUM, "browser")]
    if os.environ.get("LLAMA_CPP_BIN"):
        places.append((os.environ["LLAMA_CPP_BIN"], "llama_cpp"))
    return [(str(Path(p).absolute()), part) for p, part in places]


def watch() -> None:
    """From now on, record in :data:`USED` each part whose files this process opens or whose programs it starts
    (an audit hook: the files opened here, the commands of the processes started here), and the Chromium of
    Playwright's driver."""
    places = _watched()

    def check(value) -> None:
        if isinstance(value, bytes):
            value = os.fsdecode(value)
        elif isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            return
        for word in value.split() if " " in value else (value,):
            path = word if word.startswith(os.sep) else os.path.abspath(word) if "/" in word else None
            if path is not None:
                for prefix, part in places:
                    if path.startswith(prefix):
                        USED.setdefault(part, value)
                        return
        if "playwright" in value and "driver" in value:
            USED.setdefault("browser", value)

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open":
                check(args[0])
            elif event in ("subprocess.Popen", "os.posix_spawn", "os.exec"):
                check(args[0])
                for arg in args[1] if isinstance(args[1], (list, tuple)) else (args[1],):
                    check(arg)
        except Exception:  # never fail the operation watched
            pass

    sys.addaudithook(hook)
