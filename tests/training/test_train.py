"""`selfattn train`: configs and flags, exact resume after a SIGKILL mid-save (fresh processes),
non-finite loss, DDP and FSDP2 on CPU against one process, and a run that learns."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from selfattn.cli import main
from selfattn.config import GPTConfig
from selfattn.model import GPT
from selfattn.training import checkpoint
from selfattn.training.config import TrainConfig
from selfattn.training.loop import lr_at

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count in every process
MICRO = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--grad-accum", "2", "--warmup-steps", "2", "--set", "eval_batches=2", "--set", "keep=3"]
RESUMED = MICRO + ["--max-steps", "6", "--save-every", "2", "--eval-every", "3", "--dropout", "0.1"]

# Runs `selfattn train` with the checkpoint's fsync patched to SIGKILL the process right after the
# temporary file of step 4 is complete and synced, before it is renamed: the worst moment to die.
KILL_DURING_SAVE = """
import os, signal, sys
from pathlib import Path
from selfattn._util import files as _files
from selfattn.cli import main

fsync = _files.fsync
def fsync_then_die(path):
    fsync(path)
    if Path(path).name.startswith(".ckpt-0000004.safetensors.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)
_files.fsync = fsync_then_die
sys.exit(main(sys.argv[1:]))
"""


def _selfattn(*args, script=None):
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "-m", "selfattn"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300, env=ENV)


def _records(run):
    """The per-step and eval records of a run's log, without timings."""
    out = []
    for line in (run / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        r.pop("tokens_per_s", None)
        out.append(r)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-step run, and the same run SIGKILLed while saving step 4, then resumed
    by a fresh process: {"whole": path, "resumed": path, "after_kill": [file names]}."""
    tmp = tmp_path_factory.mktemp("resume")
    whole, resumed = tmp / "whole", tmp / "resumed"
    r = _selfattn("train", *RESUMED, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    r = _selfattn("train", *RESUMED, "--out", str(resumed), script=KILL_DURING_SAVE)
    assert r.returncode == -9, r.stderr  # SIGKILL
    after_kill = sorted(p.name for p in resumed.iterdir())
    last_good = checkpoint.load(resumed / "ckpt-0000002.safetensors")  # loadable despite the kill
    assert last_good["step"] == 2
    r = _selfattn("train", "--resume", "--out", str(resumed))
    assert r.returncode == 0, r.stderr
    assert "resuming at step 2" in r.stdout
    return {"whole": whole, "resumed": resumed, "after_kill": after_kill}


@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_sigkill_during_a_save_leaves_the_last_checkpoint(runs):
    names = runs["after_kill"]
    assert "ckpt-0000002.safetensors" in names and "ckpt-0000004.safetensors" not in names
    assert any(n.startswith(".ckpt-0000004.safetensors.tmp-") for n in names)  # the kill hit mid-save
    assert not any(n.startswith(".ckpt-") for n in os.listdir(runs["resumed"]))  # cleaned up by the next save


@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_resume_in_a_fresh_process_equals_the_uninterrupted_run(runs):
    whole, resumed = _records(runs["whole"]), _records(runs["resumed"])
    assert [r["step"] for r in whole if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert resumed == whole  # every loss, lr, gradient norm and val loss, bit for bit
    a, _ = checkpoint.read_weights(runs["whole"] / "ckpt-0000006.safetensors")
    b, _ = checkpoint.read_weights(runs["resumed"] / "ckpt-0000006.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_resume_checker_can_fail(runs, tmp_path):
    """Negative control: the same run with another seed differs, so equality above is not vacuous."""
    assert main(["train", *RESUMED, "--max-steps", "2", "--seed", "1", "--out", str(tmp_path)]) == 0
    other = [r["loss"] for r in _records(tmp_path) if "loss" in r]
    whole = [r["loss"] for r in _records(runs["whole"]) if "loss" in r][:2]
    assert other != whole


@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_checkpoint(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["resumed"], run)
    last = run / "ckpt-0000006.safetensors"
    digest = hashlib.sha256(last.read_bytes()).hexdigest()
    assert main(["train", "--resume", "--out", str(run), "--lr", "1e30", "--max-steps", "10"]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the closed progress bar
    assert last_line == (f"selfattn train: error: loss is nan at step 8; stopped without saving, "
                         f"the last good checkpoint is {last}")
    assert checkpoint.latest(run) == last and hashlib.sha256(last.read_bytes()).hexdigest() == digest
    assert checkpoint.load(last)["step"] == 6


def _torchrun(*args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "selfattn"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.slow  # make check leaves it out: torchrun's process groups
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_cpu_processes_equal_one_with_the_same_global_batch(tmp_path, mode):
    flags = MICRO + ["--max-steps", "3", "--save-every", "3", "--eval-every", "3", "--lr", "1e-2"]
    r = _torchrun("train", *flags, "--out", str(tmp_path / mode), *(["--fsdp"] if mode == "fsdp" else []))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("selfattn train: done") == 1 and "2 rank(s) on cpu" in r.stdout  # rank 0 alone prints
    assert main(["train", *flags, "--out", str(tmp_path / "one")]) == 0
    two, _ = checkpoint.read_weights(tmp_path / mode / "ckpt-0000003.safetensors")
    one, _ = checkpoint.read_weights(tmp_path / "one" / "ckpt-0000003.safetensors")
    torch.manual_seed(0)
    start = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=16)).state_dict()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
        if name.endswith("weight") and "ln" not in name:  # control: training moved them far beyond the tolerance
            assert (one[name] - start[name]).abs().max() > 1e-3, name
    losses = [[r["loss"] for r in _records(tmp_path / d) if "loss" in r] for d in (mode, "one")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.slow  # make check leaves it out: torchrun's process groups
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lora_on_two_cpu_processes_equals_one(tmp_path, mode):
    base = tmp_path / "base"
    assert main(["train", *MICRO, "--max-steps", "2", "--out", str(base)]) == 0
    flags = ["--init-from", str(base), "--lora-rank", "2", "--lora-mlp", "--batch-size", "4", "--max-steps", "3",
             "--save-every", "3", "--eval-every", "3", "--set", "eval_batches=1", "--lr", "1e-2", "--warmup-steps", "1"]
    r = _torchrun("train", *flags, "--out", str(tmp_path / mode), *(["--fsdp"] if mode == "fsdp" else []))
    assert r.returncode == 0, r.stderr[-3000:]
    assert main(["train", *flags, "--out", str(tmp_path / "one")]) == 0
    two, _ = checkpoint.read_weights(tmp_path / mode / "ckpt-0000003.safetensors")
    one, _ = checkpoint.read_weights(tmp_path / "one" / "ckpt-0000003.safetensors")
    assert set(two) == set(one) and all(k.endswith((".lora_A", ".lora_B")) for k in one)  # the adapters alone
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    assert all(one[k].abs().max() > 1e-3 for k in one if k.endswith("lora_B"))  # control: B left zero


@pytest.mark.slow  # make check leaves it out: torchrun's process groups
@pytest.mark.parametrize("nproc, n, pos", [(2, 2, "learned"), (4, 2, "rope")], ids=["cp2", "dp2xcp2"])
def test_context_parallel_training_equals_one_process_step_for_step(tmp_path, nproc, n, pos):
    """Each sequence split over n ranks (ring attention), DDP over the rings: the same losses,
    gradient norms and weights as one process with the same global batch."""
    flags = MICRO + ["--max-steps", "3", "--save-every", "3", "--eval-every", "3", "--lr", "1e-2",
                     "--set", f"pos={pos}"]
    r = _torchrun("train", *flags, "--out", str(tmp_path / "cp"), "--context-parallel", str(n), nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{nproc} rank(s) ({nproc // n} x {n}: each sequence over {n})" in r.stdout
    assert main(["train", *flags, "--out", str(tmp_path / "one")]) == 0
    split, _ = checkpoint.read_weights(tmp_path / "cp" / "ckpt-0000003.safetensors")
    one, _ = checkpoint.read_weights(tmp_path / "one" / "ckpt-0000003.safetensors")
    for name in one:
        torch.testing.assert_close(split[name], one[name], rtol=1e-5, atol=1e-6)
    for key in ("loss", "grad_norm", "val_loss"):
        runs = [[r[key] for r in _records(tmp_path / d) if key in r] for d in ("cp", "one")]
        assert len(runs[0]) >= 2 and runs[0] == pytest.approx(runs[1], rel=1e-5), key


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel", "2"], "--context-parallel 2 splits each sequence across processes: launch with torchrun"),
    (["--context-parallel", "2", "--dropout", "0.1"], "ring attention serves causal attention with a sliding window, "
                                                       "not dropout=0.1"),
    (["--context-parallel", "2", "--fsdp"], "context_parallel=2 runs with DDP, eagerly: not with fsdp"),
])
def test_context_parallel_refusals_are_one_line(tmp_path, capsys, flags, message):
    assert main(["train", *MICRO, "--max-steps", "1", "--out", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r" / "log.jsonl").exists()


@pytest.mark.parametrize("key, value, launch, alone", [
    ("context_parallel", 2, "torchrun --nproc_per_node=2", ["--context-parallel", "1"]),
    ("fsdp", True, "torchrun --nproc_per_node=N", ["--no-fsdp"])])
def test_resuming_a_many_process_run_in_one_process_says_the_value_is_the_runs(tmp_path, capsys, key, value,
                                                                              launch, alone):
    out = tmp_path / "run"
    flags = MICRO + ["--max-steps", "2", "--save-every", "2", "--eval-every", "2"]
    assert main(["train", *flags, "--out", str(out)]) == 0
    ckpt = out / "ckpt-0000002.safetensors"
    tensors, header = checkpoint.read(ckpt)  # as if the run had been launched with torchrun and `key`
    header["meta"]["train"][key] = value
    header["sha256"] = checkpoint.digest(tensors, header)
    checkpoint._write_atomic(ckpt, tensors, json.dumps(header))
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err == (f"selfattn train: error: --resume: the run's checkpoint {ckpt} has {key}={value!r}, which needs "
                   f"several processes: launch with {launch}, or pass {' '.join(alone)} to continue in this one\n")
    assert not (out / "ckpt-0000003.safetensors").exists()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "3", *alone]) == 0  # the way it names
    assert (out / "ckpt-0000003.safetensors").exists()


def test_a_short_run_learns(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                 "--batch-size", "8", "--max-steps", "40", "--lr", "2e-2", "--warmup-steps", "3",
                 "--eval-every", "40", "--set", "eval_batches=4", "--save-every", "40", "--out", str(out)]) == 0
    val = [r["val_loss"] for r in _records(out) if "val_loss" in r]
    assert val[0] > 5.4 and val[-1] < 4.0  # from uniform over 256 bytes (ln 256 = 5.55) to letter statistics
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG") and (out / "config.json").exists()


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert [lr_at(s, cfg) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_at(60, cfg) == pytest.approx(0.55) and lr_at(110, cfg) == pytest.approx(0.1)
    decay = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lr_at(1000, cfg) == pytest.approx(0.1)  # past max_steps (a resumed, extended run) it stays at min_lr


def test_flags_come_from_the_dataclasses_with_their_help():
    from selfattn.cli import build_parser, flags
    from selfattn.cli.train import MODEL_FLAGS, TRAIN_FLAGS

    parser = build_parser(["train"])
    args = parser.parse_args(["train", "--n-layer", "3", "--no-bias", "--set", "window=none", "--lr", "2e-3", "--bf16",
                              "--set", "window_layers=[true, false, true]", "--set", "keep=4"])
    model, training = flags.given(args, GPTConfig), flags.given(args, TrainConfig)
    assert model == {"n_layer": 3, "bias": False, "window": None, "window_layers": [True, False, True]}
    assert training == {"lr": 2e-3, "bf16": True, "keep": 4}  # only what was typed; vocab from data
    help_text = " ".join(parser._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "peak learning rate, reached after the warmup" in help_text  # the fields' own help
    assert "number of transformer blocks" in help_text and "--set FIELD=VALUE" in help_text
    train = parser._subparsers._group_actions[0].choices["train"]
    flags_shown = [a for a in train._actions if a.option_strings]
    own = ("--help", "--out", "--preset", "--arch", "--config", "--resume", "--base", "--set")  # the command's own
    assert len(flags_shown) <= len(MODEL_FLAGS) + len(TRAIN_FLAGS) + len(own)  # the flags people reach for, not 67
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--n-layer", "four"])


@pytest.mark.parametrize("setting, message", [
    ("windw=8", "--set windw=8: no field 'windw'; did you mean 'window'?"),
    ("window", "--set takes FIELD=VALUE, got 'window'"),
    ("window=wide", "--set window=wide: window takes int or none"),
    ("window_layers=[1", "--set window_layers=[1: window_layers takes a JSON list or none"),
])
def test_set_refuses_an_unknown_field_or_a_value_in_one_line(setting, message, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--set", setting]) == 2
    assert capsys.readouterr().err == f"selfattn train: error: {message}\n"
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


@pytest.mark.parametrize("content, message", [
    ({"train": {"learning_rate": 1e-3}}, "unknown TrainConfig key 'learning_rate'"),
    ({"model": {"n_layers": 2}}, "unknown GPTConfig key 'n_layers'; did you mean 'n_layer'?"),
    ({"model": {"n_layer": "4"}}, "GPTConfig key 'n_layer' must be int, got str '4'"),
    ({"train": {"bf16": 1}}, "TrainConfig key 'bf16' must be bool, got int 1"),
    ({"optimizer": {}}, "expected an object with keys 'model' and/or 'train', got ['optimizer']"),
    ({"model": {"vocab_size": 100}}, "'vocab_size' is set by the tokenizer"),
])
def test_config_file_errors_name_the_key(tmp_path, capsys, content, message):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(content))
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and message in err


def test_config_file_layers_over_the_preset_and_flags_over_both(tmp_path):
    from selfattn.training.resume import resolve_configs

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model": {"n_layer": 3}, "train": {"lr": 5e-4, "max_steps": 7}}))
    model_cfg, train_cfg, resume, source = resolve_configs(tmp_path / "run", preset="tiny", config=str(path),
                                                           train_flags={"max_steps": 9})
    assert (model_cfg.n_layer, model_cfg.n_embd, train_cfg.lr, train_cfg.max_steps, resume, source) == \
        (3, 128, 5e-4, 9, None, None)


@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_resume_refusals(runs, tmp_path, capsys):
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", *MICRO, "--out", str(runs["whole"])]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--n-embd", "32", "--out", str(runs["whole"])]) == 2
    assert "n_embd=32 differs from the checkpoint's n_embd=16" in capsys.readouterr().err
    shutil.copytree(runs["whole"], tmp_path / "done")
    assert main(["train", "--resume", "--out", str(tmp_path / "done")]) == 0
    assert "nothing to do" in capsys.readouterr().out


def _tree(folder):
    """{relative path: SHA-256} of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flags, message", [
    (["--set", "val_fraction=0.5"], "val_fraction=0.5 differs from the checkpoint's val_fraction=0.1; another "
                                     "split would move trained tokens into validation"),
    (["--tokenizer", "bpe"], "tokenizer='bpe' differs from the checkpoint's tokenizer='byte'; the model's "
                             "vocabulary and the token cache come from it"),
    (["--data", "OTHER"], "is not the one this run was trained on"),
])
@pytest.mark.slow  # make check leaves it out: the kill-and-resume runs: three processes
def test_a_resume_that_would_change_the_tokens_is_refused_before_writing(runs, tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    shutil.copytree(runs["whole"], run)
    (tmp_path / "other.txt").write_text("another corpus " * 200)
    before = _tree(run)
    flags = [str(tmp_path / "other.txt") if f == "OTHER" else f for f in flags]
    assert main(["train", "--resume", *flags, "--max-steps", "8", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert _tree(run) == before  # tokens/, the log, the checkpoints: nothing rewritten


def test_resuming_what_train_did_not_write_is_one_line(tmp_path, capsys):
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    checkpoint.save(tmp_path / "run", 3, model, torch.optim.AdamW(model.parameters()), meta={"model": {}}, keep=1)
    assert main(["train", "--resume", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"selfattn train: error: --resume: {tmp_path / 'run' / 'ckpt-0000003.safetensors'} was not written "
                   f"by selfattn train (its meta has no 'train')\n")
    (tmp_path / "file").write_text("")
    assert main(["train", "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == f"selfattn train: error: {str(tmp_path / 'file')!r} is a file, not a folder\n"


def test_bf16_autocast_trains_close_to_float32(tmp_path):
    flags = MICRO + ["--max-steps", "2", "--save-every", "2", "--eval-every", "2"]
    assert main(["train", *flags, "--out", str(tmp_path / "fp32")]) == 0
    assert main(["train", *flags, "--bf16", "--out", str(tmp_path / "bf16")]) == 0
    fp32, bf16 = ([r["loss"] for r in _records(tmp_path / d) if "loss" in r] for d in ("fp32", "bf16"))
    assert fp32 != bf16 and bf16 == pytest.approx(fp32, rel=2e-2)  # bfloat16 really ran, and stayed close


def test_train_config_values_are_checked():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="tokenizer must be 'byte' or 'bpe', got 'wordpiece'"):
        TrainConfig(tokenizer="wordpiece")
    assert math.isclose(TrainConfig().lr, 1e-3)


@pytest.mark.parametrize("files", [
    {"config.json": '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}', "model.safetensors": "w"},
    {"config.json": '{"lr": 0.1}', "notes.txt": "my notes"},  # a user's project
    {"notes.txt": "my notes"},
])
def test_a_folder_that_is_not_a_run_is_refused_and_left_untouched(files, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    assert main(["train", *MICRO, "--max-steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty and is not a selfattn run (it holds" in err, err
    assert {p.name: p.read_text() for p in out.iterdir()} == files  # nothing written, nothing replaced
    (out / "config.json").unlink(missing_ok=True)  # control: the same files less a config are still not a run
    assert main(["train", *MICRO, "--max-steps", "1", "--out", str(out)]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *MICRO, "--max-steps", "1", "--eval-every", "1", "--out", str(empty)]) == 0  # control


def test_resume_accepts_the_original_commands_preset_when_it_agrees_with_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    tiny = ["--preset", "tiny", "--max-steps", "2", "--eval-every", "2", "--set", "eval_batches=1", "--batch-size",
            "4", "--out", str(out)]
    assert main(["train", *tiny]) == 0
    assert main(["train", *tiny[:-2], "--max-steps", "3", "--out", str(out), "--resume"]) == 0  # the same command
    assert main(["train", "--preset", "small", "--out", str(out), "--resume", "--max-steps", "4"]) == 2  # control
    err = capsys.readouterr().err
    assert "--resume: --preset small sets block_size=256 but the run has block_size=128" in err, err
