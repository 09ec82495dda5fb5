"""Every kind of model the library loads, here: the random models of tests/helpers/families.py (every option of
each family on) and a GPT-2, each saved by ``transformers`` and loaded by ``selfattn.io.loading.load``; two training
runs of a grouped-query Llama-shaped byte model, one fine-tuned whole and one with LoRA adapters (on attention and
MLP), loaded as runs and exported to a folder; and the two real models (marked ``models``), their GGUF files
loaded in float32 and exported to a folder of the same weights and tokenizer."""
from pathlib import Path

import pytest

from benchmarks import assets
from selfattn.cli import main
from selfattn.config import GPTConfig
from selfattn.io import loading
from selfattn.io.export import Special, export
from selfattn.model import GPT
from selfattn.tokenizers import ByteTokenizer

from helpers.families import CASES, build
from helpers.gpt2 import gpt2_folder
from helpers.models import byte_run

REAL = [pytest.param(f"{name}.gguf", marks=pytest.mark.models) for name in assets.MODELS]  # SmolLM2, Gemma 3
RUNS = {"run": [], "lora-run": ["--lora-rank", "4", "--lora-mlp"]}  # name -> how train fine-tunes it
FAMILIES = ["gpt2", *CASES, *RUNS, *REAL]
_loaded: dict[str, tuple] = {}  # name -> (name, folder, model): each loaded once a worker, for both fixtures


@pytest.fixture(scope="session", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, folder, our float32 model in eval mode)."""
    return _load(request.param, tmp_path_factory)


@pytest.fixture(scope="session", params=REAL)
def real(request, tmp_path_factory):
    """:func:`family`'s triple for the two real models alone."""
    return _load(request.param, tmp_path_factory)


def _load(name: str, tmp_path_factory) -> tuple:
    if name not in _loaded:
        folder = tmp_path_factory.mktemp(name)
        if name in RUNS:
            model = _run(name, folder.parent / f"{name}-training")
            export(model, ByteTokenizer(), folder, force=True)
        elif name.endswith(".gguf"):
            source = loading.load(assets.MODELS[name.removesuffix(".gguf")].path)
            model = source.model.float().eval()
            export(model, source.require_tokenizer(), folder, force=True, special=Special.of(source))
        else:
            (gpt2_folder(folder, n_layer=2, n_head=4, n_embd=64) if name == "gpt2"
             else build(name).save_pretrained(folder))
            model = loading.load(folder).model.eval()
        _loaded[name] = name, folder, model
    return _loaded[name]


def _run(name: str, tmp: Path) -> GPT:
    """A run of ``selfattn train`` in ``tmp``, three steps from a random base run, loaded as the commands load it."""
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, pos="rope",
                       norm="rmsnorm", mlp_kind="swiglu", tie_embeddings=False)
    byte_run(tmp / "base", config)
    (tmp / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main(["train", "--init-from", str(tmp / "base"), "--data", str(tmp / "data.txt"), "--seq-len", "32",
                 *RUNS[name], "--batch-size", "2", "--max-steps", "3", "--lr", "3e-2", "--warmup-steps", "1",
                 "--eval-every", "3", "--set", "eval_batches=1", "--out", str(tmp / "run")]) == 0
    return loading.load(tmp / "run").model.eval()
