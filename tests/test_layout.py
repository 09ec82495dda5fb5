"""The layout's rules, checked on the source itself.

Imports flow one way (no cycle between files of the package; models, tokenizers and formats import
nothing of the loader, training, the tools or the commands above them); only the command package
parses flags, prints or exits; the dispatcher imports no command it does not run; every
backend declares the one contract; no run of six identical lines of code stands twice.
"""
import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import selfattn
from selfattn import backends

PACKAGE = Path(selfattn.__file__).parent
ROOT = PACKAGE.parent
CLI = PACKAGE / "cli"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every file of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # `from a import b`: the module a.b when it is one, else a
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    return {name for name in found if name in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_between_files_of_the_package():
    modules = _modules()
    graph = {name: _imported(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# rooms below the loader (what they may not import): model files, tokenizers and formats know
# nothing of the loader, training, the tools or the commands above them
BELOW_THE_LOADER = ("selfattn.models", "selfattn.tokenizers", "selfattn.formats")
ABOVE = ("selfattn.loading", "selfattn.export", "selfattn.training", "selfattn.audit", "selfattn.analysis",
         "selfattn.bench", "selfattn.cli", "selfattn.hf")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every module a of a room below the loader importing a module b above it."""
    below = [m for m in graph if m.startswith(BELOW_THE_LOADER)]
    return [f"{a} -> {b}" for a in sorted(below) for b in sorted(graph[a])
            if b == "selfattn.training" or b.startswith(tuple(f"{r}." for r in ABOVE) + ABOVE)]


def test_tokenizers_formats_and_models_import_nothing_above_them():
    modules = _modules()
    graph = {name: _imported(path, modules) - {name} for name, path in modules.items()}
    assert {"selfattn.tokenizers", "selfattn.formats", "selfattn.models"} <= set(graph)
    assert not _upward_imports(graph), "\n".join(_upward_imports(graph))
    assert not [m for m in graph if m.startswith("selfattn.training.") and "token" in m]  # tokenizers left training


def test_the_upward_import_finder_finds_one():  # negative control
    graph = {"selfattn.formats.gguf": {"selfattn.training.checkpoint"}, "selfattn.loading": {"selfattn.formats"}}
    assert _upward_imports(graph) == ["selfattn.formats.gguf -> selfattn.training.checkpoint"]


def test_the_cycle_finder_finds_a_cycle():  # negative control
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _library_files() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if CLI not in p.parents and p.name != "__main__.py"]


def test_only_the_command_package_parses_flags_prints_or_exits():
    offences = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                if "argparse" in names:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} imports argparse")
            elif isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f"{getattr(f.value, 'id', '?')}.{f.attr}" \
                    if isinstance(f, ast.Attribute) else ""
                if name in ("print", "exit", "quit", "sys.exit", "os._exit"):
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
    assert not offences, "\n".join(offences)


def test_the_dispatcher_imports_only_the_chosen_command():
    code = ("import sys; from selfattn.cli import build_parser; build_parser(['sample']); "
            "print(sorted(m for m in sys.modules if m.startswith('selfattn.cli.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['selfattn.cli.sample']"


@pytest.mark.parametrize("name", backends.NAMES)
def test_every_backend_declares_the_contract(name):
    if name == "triton":
        pytest.importorskip("triton")
    impl = backends.load(name)
    assert isinstance(impl.RETURNS_WEIGHTS, bool)
    for attr in ("available", "unsupported", "run"):
        assert callable(getattr(impl, attr)), f"backend {name!r} has no {attr}()"
    assert hasattr(impl, "run_with_weights") == impl.RETURNS_WEIGHTS
    why = impl.available(torch.device("cpu"))
    assert why is None or isinstance(why, str) and why
    assert backends.availability(name, "cpu") == why


CODE_LINES = 6  # a run this long of identical lines of code may stand in one place only


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that are code: not blank, not comments, not imports."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if text and not text.startswith(("#", "import ", "from ")) and text not in ('"""', "'''"):
            lines.append((number, text))
    return lines


def _repeated_runs(paths: list[Path], n: int) -> list[list[tuple[str, int]]]:
    """Every run of ``n`` code lines that stands in more than one place, as its [(file, line)]."""
    places = defaultdict(list)
    for path in paths:
        lines = _code_lines(path)
        for k in range(len(lines) - n + 1):
            places[tuple(text for _, text in lines[k:k + n])].append((str(path), lines[k][0]))
    return [where for where in places.values() if len(where) > 1]


def test_no_six_identical_lines_of_code_stand_twice():
    paths = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")])
    repeated = _repeated_runs(paths, CODE_LINES)
    assert not repeated, "\n".join(" ~ ".join(f"{p}:{line}" for p, line in where) for where in repeated)


def test_the_repetition_finder_finds_a_repetition(tmp_path):  # negative control
    body = "".join(f"x{i} = {i}\n" for i in range(CODE_LINES))
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("y = 0\n# a comment\n" + body.replace("x0", "\n\nx0"))
    assert len(_repeated_runs([tmp_path / "a.py", tmp_path / "b.py"], CODE_LINES)) == 1
    assert not _repeated_runs([tmp_path / "a.py", tmp_path / "b.py"], CODE_LINES + 1)
