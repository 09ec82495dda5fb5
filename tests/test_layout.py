"""The layout's rules, checked on the source itself.

Imports flow one way (no cycle between files of the package, nor between its rooms; the private helpers
import no room; models, tokenizers, formats and LoRA import nothing of the loader, training, the tools or
the commands above them); only the command package parses flags, prints or exits; the dispatcher imports
no command it does not run; every backend declares the one contract; no run of six identical lines of code
stands twice; the code holds a handful of measured figures at most (the rest are in ``docs/benchmarks.md``).
"""
import ast
import re
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


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every file of ``package``."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that importing ``path`` (the module ``name``) runs, at module level or
    inside functions: each module it imports, and each package ``__init__`` above that module, which
    Python runs first (but the importer's own packages, which are running or ran already)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # `from a import b`: the module a.b when it is one, else a
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return {m for m in found | (parents - own) if m in modules} - {name}


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imported(name, path, modules) for name, path in modules.items()}


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
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_the_cycle_finder_counts_the_packages_an_import_runs(tmp_path):  # the old tree's cycle, a negative control
    # the kernel imported a helper of the backends' package, whose __init__ imports sdpa, which imports the kernel
    old = _tree(tmp_path / "old", {"pkg/__init__.py": "", "pkg/backends/_common.py": "",
                                   "pkg/stream_kernel.py": "from pkg.backends import _common\n",
                                   "pkg/backends/__init__.py": "from pkg.backends import sdpa\n",
                                   "pkg/backends/sdpa.py": "from pkg import stream_kernel\n"})
    assert _cycle(_graph(old)) == ["pkg.backends", "pkg.backends.sdpa", "pkg.stream_kernel", "pkg.backends"]
    new = _tree(tmp_path / "new", {"pkg/__init__.py": "", "pkg/kernels/__init__.py": "", "pkg/kernels/features.py": "",
                                   "pkg/kernels/stream.py": "from pkg.kernels import features\n",
                                   "pkg/backends/__init__.py": "from pkg.backends import sdpa\n",
                                   "pkg/backends/sdpa.py": "from pkg.kernels import stream\n"})
    assert _cycle(_graph(new)) is None


# rooms below the loader (what they may not import): model files, tokenizers, formats and LoRA know
# nothing of the loader (all of io/), training, the tools or the commands above them
BELOW_THE_LOADER = ("selfattn.families", "selfattn.tokenizers", "selfattn.formats", "selfattn.lora")
ABOVE = ("selfattn.io", "selfattn.training", "selfattn.serve", "selfattn.audit", "selfattn.analysis", "benchmarks",
         "selfattn.cli")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every module a of a room below the loader importing a module b above it."""
    below = [m for m in graph if m.startswith(BELOW_THE_LOADER)]
    return [f"{a} -> {b}" for a in sorted(below) for b in sorted(graph[a])
            if b == "selfattn.training" or b.startswith(tuple(f"{r}." for r in ABOVE) + ABOVE)]


def test_tokenizers_formats_and_models_import_nothing_above_them():
    graph = _graph()
    assert {"selfattn.tokenizers", "selfattn.formats", "selfattn.families"} <= set(graph)
    assert not _upward_imports(graph), "\n".join(_upward_imports(graph))
    assert not [m for m in graph if m.startswith("selfattn.training.") and "token" in m]  # tokenizers left training


# the rooms at or below the model (what they may not import): the attention core, the kernels, the backends,
# the config and the model know nothing of generation, loading, families, training, the tools or the commands
AT_OR_BELOW_THE_MODEL = ("selfattn.self_attention", "selfattn.masks", "selfattn.scores", "selfattn.rope",
                         "selfattn.norms", "selfattn.kv_cache", "selfattn.kernels", "selfattn.backends",
                         "selfattn.config", "selfattn.loss", "selfattn.model", "selfattn.taps")
ABOVE_THE_MODEL = ("selfattn.generation", "selfattn.io", "selfattn.families", "selfattn.tokenizers", "selfattn.lora",
                   "selfattn.training", "selfattn.serve", "selfattn.audit", "selfattn.analysis", "selfattn.interp",
                   "selfattn.cli")


def _imports_of(graph: dict[str, set[str]], rooms: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """``a -> b`` for every module a of ``rooms`` importing a module b of ``forbidden``."""
    def inside(m: str, names: tuple[str, ...]) -> bool:
        return any(m == r or m.startswith(r + ".") for r in names)
    return [f"{a} -> {b}" for a in sorted(graph) if inside(a, rooms) for b in sorted(graph[a]) if inside(b, forbidden)]


def test_nothing_at_or_below_the_model_imports_what_sits_above_it():
    graph = _graph()
    assert not _imports_of(graph, AT_OR_BELOW_THE_MODEL, ABOVE_THE_MODEL)
    assert not _imports_of(graph, ("selfattn.kernels",), ("selfattn.backends", "selfattn.self_attention",
                                                          "selfattn.model"))
    assert not _imports_of(graph, ("selfattn.io",), ("selfattn.training", "selfattn.audit", "selfattn.analysis",
                                                     "selfattn.cli"))  # loading reads checkpoints; training writes them
    assert _imports_of({"selfattn.model": {"selfattn.generation.steps"}}, AT_OR_BELOW_THE_MODEL,
                       ABOVE_THE_MODEL) == ["selfattn.model -> selfattn.generation.steps"]  # negative control


def test_interpretability_sits_above_the_model_and_beside_generation():
    graph = _graph()  # the model reaches interp's hooks only through its generic tap (selfattn.taps)
    assert "selfattn.interp" in graph and "selfattn.taps" in graph
    assert not _imports_of(graph, ("selfattn.generation", "selfattn.serve"), ("selfattn.interp",))
    assert _imports_of({"selfattn.generation.generate": {"selfattn.interp.sites"}}, ("selfattn.generation",),
                       ("selfattn.interp",)) == ["selfattn.generation.generate -> selfattn.interp.sites"]  # control


def _private_uses(paths: list[Path], private: set[str]) -> list[str]:
    """``file:line .name`` for every attribute of ``private`` that the files read."""
    return [f"{p.relative_to(ROOT)}:{node.lineno} .{node.attr}" for p in paths
            for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Attribute) and node.attr in private]


def test_generation_uses_only_the_models_public_api():
    model = ast.parse((PACKAGE / "model.py").read_text())
    private = {n.name for c in ast.walk(model) if isinstance(c, ast.ClassDef) for n in c.body
               if isinstance(n, ast.FunctionDef) and n.name.startswith("_") and not n.name.startswith("__")}
    private |= {t.attr for n in ast.walk(model) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and t.attr.startswith("_")}
    assert "_init_weights" in private
    generation = sorted((PACKAGE / "generation").glob("*.py"))
    assert not _private_uses(generation, private)
    assert _private_uses([PACKAGE / "model.py"], private)  # negative control: the model itself uses them


def test_the_upward_import_finder_finds_one():  # negative control
    graph = {"selfattn.formats.gguf": {"selfattn.training.checkpoint"},
             "selfattn.io.loading": {"selfattn.formats"}}
    assert _upward_imports(graph) == ["selfattn.formats.gguf -> selfattn.training.checkpoint"]


def _room(module: str) -> str | None:
    """The room of a module of the package: ``selfattn.X`` for the file or folder X at the package's root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "selfattn" and len(parts) > 1 else None


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms' graph: room a -> room b when a module of a imports a module of b."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, imported in graph.items():
        if room := _room(a):
            rooms[room] |= {r for b in imported if (r := _room(b)) and r != room}
    return {room: rooms[room] for room in {*rooms, *(r for rs in rooms.values() for r in rs)}}


def _below_the_helpers(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every private helper a (``selfattn._util``) importing a module b of another room."""
    return [f"{a} -> {b}" for a in sorted(graph) if _room(a) == "selfattn._util"
            for b in sorted(graph[a]) if _room(b) != "selfattn._util"]


def test_no_two_rooms_import_each_other():
    # a room's piece that a room below it needs lives on the floor both share: the file formats (peft's
    # folders, the checkpoint digest) below LoRA and the loader, the JSON reader with the private helpers
    graph = _graph()
    assert {"selfattn.formats", "selfattn.lora", "selfattn.io", "selfattn._util"} <= set(_rooms(graph))
    cycle = _cycle(_rooms(graph))
    assert cycle is None, " -> ".join(cycle)
    assert not _below_the_helpers(graph)  # the private helpers import no room: every room may use them


def test_the_room_finder_finds_the_old_arrows():  # negative control: the old tree's two arrows back up
    old = {"selfattn.lora": {"selfattn.io.formats.peft", "selfattn.io.formats.checkpoint", "selfattn.model"},
           "selfattn.io.loading": {"selfattn.lora", "selfattn.tokenizers.bpe"},
           "selfattn.io.formats.peft": {"selfattn.io.formats.checkpoint"},
           "selfattn.tokenizers.bpe": {"selfattn.io.formats.jsonfile", "selfattn._util.validate"},
           "selfattn._util.validate": set()}
    assert _rooms(old)["selfattn.lora"] == {"selfattn.io", "selfattn.model"}
    assert _cycle(_rooms(old)) == ["selfattn.io", "selfattn.lora", "selfattn.io"]
    del old["selfattn.lora"]
    assert _cycle(_rooms(old)) == ["selfattn.io", "selfattn.tokenizers", "selfattn.io"]
    old["selfattn.tokenizers.bpe"] = {"selfattn._util.jsonfile"}
    assert _cycle(_rooms(old)) is None
    assert _below_the_helpers({"selfattn._util.plot": {"selfattn._util.files", "selfattn.model"}}) == [
        "selfattn._util.plot -> selfattn.model"]


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


PROBES_RAISE = """
import importlib, pkgutil, sys, torch
def probe(*args):
    raise AssertionError("a CPU probe ran at import")
for name in [n for n in dir(torch.cpu) if n.startswith("_is_")]:
    setattr(torch.cpu, name, probe)
torch.backends.cpu.get_cpu_capability = probe
import selfattn
names = [m.name for m in pkgutil.walk_packages(selfattn.__path__, "selfattn.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


@pytest.mark.slow  # make check leaves it out: fresh interpreters
def test_no_import_of_the_package_runs_a_cpu_probe():
    done = subprocess.run([sys.executable, "-c", PROBES_RAISE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) > 80  # every module was imported
    late = PROBES_RAISE.replace("print(len(names))", "from selfattn.kernels import features\nfeatures.best()")
    assert "a CPU probe ran" in subprocess.run([sys.executable, "-c", late], capture_output=True, text=True,
                                               cwd=ROOT, timeout=300).stderr  # negative control: asked, it probes


@pytest.mark.slow  # make check leaves it out: a fresh interpreter for each command
@pytest.mark.parametrize("command", ["sample", "heads"])  # heads: not explore, whose check it once shared
def test_the_dispatcher_imports_only_the_chosen_command(command):
    code = (f"import sys; from selfattn.cli import build_parser; build_parser([{command!r}]); "
            "print(sorted(m for m in sys.modules if m.startswith('selfattn.cli.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"['selfattn.cli.flags', 'selfattn.cli.{command}']"  # flags: the shared definitions


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


# a measured figure: a time, a bandwidth, a rate (12.5 ms, 30 us, 28.9 GB/s, 53.5 tok/s) or a speed-up ratio
# (1.09x, 3.4×); not a constant, a size or a formula (FEW = 16, 64 K entries, 0.5 x (1 + tanh(u)))
MEASURED = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|GB/s|GFLOP/s|tok/s|tokens/s)(?![\w/])|\b\d+\.\d+(?:x|\s?×)(?!\w)")
FIGURES = 5  # the most the package may hold: the code keeps its rule, the figures go to docs/benchmarks.md


def _measured_figures(paths: list[Path]) -> list[str]:
    """``file:line text`` for each line of ``paths`` that holds a measured figure (:data:`MEASURED`)."""
    return [f"{path}:{number} {line.strip()}" for path in paths
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if MEASURED.search(line)]


def test_the_package_holds_a_handful_of_measured_figures_at_most():
    paths = sorted(path for suffix in ("py", "cpp", "h") for path in PACKAGE.rglob(f"*.{suffix}"))
    found = _measured_figures(paths)
    assert len(found) <= FIGURES, (f"{len(found)} lines of the package hold measured figures (at most {FIGURES}); "
                                   "keep the rule and its threshold in the code and move the figures to "
                                   "docs/benchmarks.md, \"Measurements the code cites\":\n" + "\n".join(found))


def test_the_figure_finder_finds_timings_and_ratios(tmp_path):  # negative control
    path = tmp_path / "kernel.py"
    path.write_text("FEW = 16  # rows; 64 K entries a task, 0.5 x (1 + tanh(u))\n"
                    "# a step took 12.5 ms, 1.3x faster\n"
                    "# 28.9 GB/s, 3.4× the time of 30 us\n")
    assert _measured_figures([path]) == [f"{path}:2 # a step took 12.5 ms, 1.3x faster",
                                         f"{path}:3 # 28.9 GB/s, 3.4× the time of 30 us"]
