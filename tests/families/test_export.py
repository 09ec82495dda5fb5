"""A run of a family's block exports as that family's ``transformers`` folder: ``transformers``
loads it and generates our tokens, and ``selfattn`` reads it back to the same logits.
``selfattn train --arch`` trains that block; a config no family says is refused."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from selfattn.cli import main  # noqa: E402
from selfattn.config import GPTConfig  # noqa: E402
from selfattn.families import writing  # noqa: E402
from selfattn.generation import generate  # noqa: E402
from selfattn.io import export, loading  # noqa: E402
from selfattn.model import GPT  # noqa: E402
from selfattn.tokenizers import ByteTokenizer  # noqa: E402

SIZES = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, n_kv_head=2)
SLIDING = dict(window=8, window_layers=[True, False])  # some layers slide, some do not
EXTRA = {"mistral": dict(window=8), "qwen2": SLIDING, "qwen3": SLIDING, "gemma2": dict(SLIDING, softcap=30.0),
         "gemma3_text": dict(SLIDING, window_rope_base=1e4, rope_base=1e6)}


def model_of(arch: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SIZES, **writing.block(arch, SIZES), **EXTRA.get(arch, {}))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from the initialisation: a misplaced tensor shows
    return model


@pytest.mark.parametrize("arch", writing.ARCHS)
def test_each_arch_exports_as_its_family_and_generates_our_tokens(arch, tmp_path):
    ours = model_of(arch)
    done = export.export(ours, ByteTokenizer(), tmp_path / "hf")
    assert done.architecture.lower().startswith(arch.split("_")[0])  # Gemma3ForCausalLM for gemma3_text
    assert done.logits_error < 1e-4
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert theirs.config.model_type == arch
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    want = theirs.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, pad_token_id=0)[:, 12:]
    assert torch.equal(torch.stack(list(generate(ours, idx, 20, temperature=0)), 1), want)
    back = loading.load(tmp_path / "hf").model.eval()
    assert torch.equal(back(idx)[0], ours(idx)[0])


def test_a_config_no_family_says_is_refused_naming_what_gpt2_lacks(tmp_path):
    model = GPT(GPTConfig(**SIZES, pos="none", alibi=True, norm="rmsnorm"))  # ALiBi without BLOOM's LayerNorms
    with pytest.raises(ValueError) as e:
        export.export(model, ByteTokenizer(), tmp_path / "hf")
    message = str(e.value)
    assert "alibi=True: GPT-2 adds no ALiBi" in message and "no family of llama, mistral" in message
    assert not (tmp_path / "hf").exists()


def test_a_folder_config_is_only_chosen_when_it_reads_back_the_same_model():  # the check behind the choice
    config = GPTConfig(**SIZES, **writing.block("llama", SIZES))
    assert writing.folder_config(config)[0] == "llama"
    softcapped = GPTConfig(**SIZES, **writing.block("llama", SIZES), softcap=20.0)  # Llama has no soft-cap
    assert writing.folder_config(softcapped) is None


@pytest.mark.slow
def test_train_arch_then_export_loads_in_transformers(tmp_path, capsys):
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--preset", "tiny", "--arch", "qwen3", "--max-steps", "4", "--eval-every", "2",
                 "--set", "eval_batches=1", "--save-every", "4", "--n-layer", "2", "--out", str(run)]) == 0
    trained = loading.load(run).model
    assert trained.config.qk_norm == "head" and trained.config.mlp_kind == "swiglu"
    assert main(["export", "--ckpt", str(run), "--out", str(hf)]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    idx = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    want = theirs.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[:, 10:]
    assert torch.equal(torch.stack(list(generate(trained.eval(), idx, 16, temperature=0)), 1), want)
