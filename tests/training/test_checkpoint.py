"""Checkpoints: exact round trip, tied weights, keep-last-K, integrity errors, no pickle execution."""
import json
import pickle

import pytest
import torch

from selfattn.config import GPTConfig
from selfattn.model import GPT
from selfattn.training import checkpoint

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _trained(seed=0, steps=2):
    torch.manual_seed(seed)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _step(model, opt, x):
    loss = model(x, x)[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def test_round_trip_is_exact_and_training_continues_identically(tmp_path):
    model, opt = _trained()
    path = checkpoint.save(tmp_path, 2, model, opt, meta={"step": 2, "note": "é"}, keep=3)
    assert path.name == "ckpt-0000002.safetensors" and checkpoint.latest(tmp_path) == path
    torch.manual_seed(123)  # other initial weights, a fresh optimizer with another lr
    model2 = GPT(CFG)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    assert checkpoint.load(path, model2, opt2) == {"step": 2, "note": "é"}
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert model2.lm_head.weight is model2.wte.weight  # still tied after loading
    assert opt2.param_groups[0]["lr"] == 1e-2 and list(opt2.param_groups[0]["betas"]) == [0.9, 0.95]
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    assert [_step(model, opt, x) for _ in range(3)] == [_step(model2, opt2, x) for _ in range(3)]
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_tied_weight_is_stored_once(tmp_path):
    from safetensors import safe_open

    model, opt = _trained()
    path = checkpoint.save(tmp_path, 1, model, opt, meta={}, keep=1)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        header = json.loads(f.metadata()["selfattn"])
    assert "model/wte.weight" in keys and "model/lm_head.weight" not in keys
    assert header["aliases"] == {"lm_head.weight": "wte.weight"}
    assert {"optim/wte.weight/exp_avg", "optim/wte.weight/exp_avg_sq", "optim/wte.weight/step"} <= keys
    weights, meta = checkpoint.read_weights(path)
    assert meta == {} and torch.equal(weights["lm_head.weight"], model.wte.weight.detach())


def test_keeps_the_newest_k_and_removes_leftover_temporaries(tmp_path):
    model, opt = _trained(steps=1)
    (tmp_path / ".ckpt-0000003.safetensors.tmp-999").write_bytes(b"half a file from a killed save")
    (tmp_path / ".tmpAb3x9Z").write_bytes(b"half a file the safetensors writer was writing when killed")
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, model, opt, meta={"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000003.safetensors", "ckpt-0000004.safetensors"]
    assert checkpoint.load(checkpoint.latest(tmp_path)) == {"step": 4}
    assert checkpoint.latest(tmp_path / "nothing") is None


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained()
    return checkpoint.save(tmp_path, 5, model, opt, meta={"step": 5}, keep=1)


def _damage(path, how):
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        raw = raw[:len(raw) * 2 // 3]
    elif how == "bit flip in the weights":
        raw[-100] ^= 0x01
    elif how == "garbage header":
        raw[8:40] = b"\xff" * 32
    elif how == "empty":
        raw = b""
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, message", [
    ("truncated", "is truncated or corrupted"),
    ("bit flip in the weights", "is corrupted (SHA-256 of its tensors and header does not match)"),
    ("garbage header", "is truncated or corrupted"),
    ("empty", "is truncated or corrupted"),
])
def test_damaged_checkpoint_is_a_one_line_error_naming_the_file(saved, how, message):
    checkpoint.read(saved)  # the control: intact, it reads
    _damage(saved, how)
    for reader in (checkpoint.read, checkpoint.load, checkpoint.read_weights):
        with pytest.raises(checkpoint.CheckpointError) as e:
            reader(saved)
        assert str(saved) in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def _edit_header(path, old: str, new: str):
    """Replace ``old`` by ``new`` (same length) in the JSON header, the way a hex editor would."""
    raw = path.read_bytes()
    escaped = [s.replace('"', '\\"').encode() for s in (old, new)]  # the header is a JSON string in the file's JSON
    assert len(escaped[0]) == len(escaped[1]) and raw.count(escaped[0]) == 1
    path.write_bytes(raw.replace(*escaped))


@pytest.mark.parametrize("old, new", [('"step": 5', '"step": 9'), ('"lr": 0.01', '"lr": 9.01'),
                                      ('"weight_decay": 0.1', '"weight_decay": 0.7')])
def test_a_one_digit_edit_of_the_header_is_refused(saved, old, new):
    _edit_header(saved, old, new)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(saved)
    assert str(e.value) == f"checkpoint {saved} is corrupted (SHA-256 of its tensors and header does not match)"


def test_the_digest_checker_can_fail(saved):
    """Negative control: the same edit with the digest recomputed reads, so the digest is what refuses it."""
    from safetensors.torch import save_file

    tensors, header = checkpoint.read(saved)
    header["meta"]["step"] = 9
    header["sha256"] = checkpoint.digest(tensors, header)
    save_file(tensors, str(saved), metadata={"selfattn": json.dumps(header)})
    assert checkpoint.load(saved) == {"step": 9}


@pytest.mark.parametrize("change, message", [
    (lambda h: h.pop("sha256"), "is corrupted (its header lacks sha256)"),
    (lambda h: h.update(format="selfattn-checkpoint-1"),
     "has format 'selfattn-checkpoint-1', which this selfattn does not read (its digest covers the tensors but not "
     "the header); it reads 'selfattn-checkpoint-2'"),
    (lambda h: h.update(format="selfattn-checkpoint-3"), "(it was written by a newer selfattn)"),
])
def test_headers_without_a_digest_or_of_another_format_are_refused(saved, change, message):
    from safetensors.torch import save_file

    tensors, header = checkpoint.read(saved)
    change(header)
    save_file(tensors, str(saved), metadata={"selfattn": json.dumps(header)})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read(saved)
    assert str(saved) in str(e.value) and message in str(e.value)


def test_a_damaged_newest_checkpoint_names_the_older_intact_one(tmp_path):
    model, opt = _trained(steps=1)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, opt, meta={"step": step}, keep=3)
    assert checkpoint.read_latest(tmp_path)[0].name == "ckpt-0000003.safetensors"
    _damage(tmp_path / "ckpt-0000003.safetensors", "bit flip in the weights")
    _damage(tmp_path / "ckpt-0000002.safetensors", "truncated")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read_latest(tmp_path)
    newest = tmp_path / "ckpt-0000003.safetensors"
    assert str(e.value).endswith(f"; the older ckpt-0000001.safetensors (step 1) is intact: move the damaged file "
                                 f"away (mv {newest} {newest}.damaged) to continue from it")
    newest.rename(f"{newest}.damaged")  # what the message says to do
    with pytest.raises(checkpoint.CheckpointError, match="; the older ckpt-0000001.safetensors"):
        checkpoint.read_latest(tmp_path)  # ckpt-2, truncated, is the newest now
    (tmp_path / "ckpt-0000002.safetensors").unlink()
    assert checkpoint.read_latest(tmp_path)[2]["meta"] == {"step": 1}
    _damage(tmp_path / "ckpt-0000001.safetensors", "empty")
    with pytest.raises(checkpoint.CheckpointError, match="; it is the run's only checkpoint$"):
        checkpoint.read_latest(tmp_path)
    assert checkpoint.read_latest(tmp_path / "nothing") is None


def test_damaged_checkpoint_through_the_cli_is_exit_2(saved, capsys):
    from selfattn.cli import main

    _damage(saved, "truncated")
    assert main(["sample", "--ckpt", str(saved.parent), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(saved) in err and "truncated or corrupted" in err


def test_a_foreign_safetensors_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "ckpt-0000001.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(checkpoint.CheckpointError, match="is not a selfattn checkpoint"):
        checkpoint.read(path)


def test_checkpoint_of_another_shape_is_refused(saved):
    with pytest.raises(checkpoint.CheckpointError, match=r"does not fit this model: missing \['blocks.2"):
        checkpoint.load(saved, GPT(GPTConfig(**{**CFG.__dict__, "n_layer": 3})))
    with pytest.raises(checkpoint.CheckpointError, match="size mismatch for wte.weight"):
        checkpoint.load(saved, GPT(GPTConfig(**{**CFG.__dict__, "n_embd": 32})))


class _Payload:
    """Unpickling this calls ``Path.touch(target)``: a pickle that runs code."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import pathlib
        return pathlib.Path.touch, (pathlib.Path(self.target),)


def test_malicious_pickle_is_never_executed(tmp_path, capsys):
    from selfattn.cli import main

    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"wte.weight": torch.zeros(2), "x": _Payload(target)}, evil)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read_weights(evil)
    assert str(evil) in str(e.value) and "\n" not in str(e.value)
    assert main(["sample", "--ckpt", str(evil), "--max-new-tokens", "1"]) == 2
    assert "was refused" in capsys.readouterr().err
    assert not target.exists()
    pickle.loads(pickle.dumps(_Payload(target)))  # the control: unpickled unsafely, the payload does run
    assert target.exists()


def test_a_plain_torch_save_state_dict_loads(tmp_path):
    model, _ = _trained()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    weights, meta = checkpoint.read_weights(tmp_path / "weights.pt")
    assert meta is None and all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
