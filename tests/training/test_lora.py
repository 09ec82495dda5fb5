"""LoRA on the one decoder (:mod:`selfattn.lora`) computes what ``peft`` computes.

Parity: a small random ``transformers`` model of each family (tests/helpers/families.py), wrapped by
``peft.get_peft_model`` with its B matrices randomised (they start at zero) and saved; the same
weights loaded here, LoRA added, peft's folder read into it; then float32 logits and the gradient of
every adapter for a loss on random targets equal peft's within 1e-5 of the largest magnitude (of
the logits; of all the adapters' gradients). Fused linears stand for several peft modules (Llama's
q/k/v), or one (Phi-3's qkv_proj and gate_up_proj, BLOOM's query_key_value, whose rows are per head).

Beyond parity: dropout draws peft's masks (one per part) from the same seed; only the adapters
train; merging changes no logit; settings and adapter state rebuild the model; a folder we write loads in
``PeftModel.from_pretrained`` with the same logits (1e-4); bad settings are one ValueError naming the
value; the base digest moves with one ulp of a base weight and not with the adapters.
"""
import copy
import json
import tempfile

import peft
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn import lora
from selfattn.formats.peft import from_peft, to_peft
from selfattn.io import loading
from selfattn.model import GPT

from helpers.families import build, tokens
from helpers.models import VARIANTS, scrambled, small

ATTN, LLAMA_MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
CASES = {  # helpers.families case -> (model_type, peft's target modules for the attention, for the MLP)
    "llama-llama3-rope": ("llama", ATTN, LLAMA_MLP),  # GQA: q 128 rows, k and v 64
    "qwen2-some-layers-slide": ("qwen2", ATTN, LLAMA_MLP),  # q, k, v biases
    "gemma3": ("gemma3_text", ATTN, LLAMA_MLP),
    "phi3": ("phi3", ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"]),  # fused: one adapter each
    "bloom": ("bloom", ["query_key_value", "dense"], ["dense_h_to_4h", "dense_4h_to_h"]),  # q, k, v per head
    "gpt-oss": ("gpt_oss", ATTN, None),  # a mixture of experts: attention only
}
PAIRS = [("llama-llama3-rope", False), ("llama-llama3-rope", True), ("qwen2-some-layers-slide", False),
         ("gemma3", True), ("phi3", True), ("bloom", True), ("gpt-oss", False)]  # (case, mlp)
RANK, ALPHA, T = 4, 8, 40
NOISE = 0.1  # the base weights' scale: at 0.2 float32 rounding alone moves gemma3's gradients by ~1e-5


def _randomised(model: nn.Module, seed: int, names=("lora_B",)) -> None:
    """Every adapter tensor whose name holds one of ``names`` drawn N(0, 0.2²) (peft's B start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _peft_model(hf, case: str, mlp: bool, dropout: float = 0.0):
    _, attn, mlp_targets = CASES[case]
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=attn + (mlp_targets if mlp else []),
                             lora_dropout=dropout)
    return peft.get_peft_model(hf, config)


def _theirs_grads(theirs) -> dict:
    return {n.replace(".default.", "."): p.grad for n, p in theirs.named_parameters() if "lora_" in n}


def _parts(ours: GPT) -> dict:
    return {name: m.parts for name, m in lora.lora_modules(ours).items()}


def _ours_grads(ours: GPT, model_type: str) -> dict:
    """Our adapters' gradients under peft's names: each part's A and B apart."""
    grads = {f"{name}.lora_{ab}": getattr(m, f"lora_{ab}").grad for name, m in lora.lora_modules(ours).items()
             for ab in "AB"}
    return to_peft(grads, _parts(ours), ours.config, model_type)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().amax() / expected.abs().amax()).item()


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{c}-{'mlp' if m else 'attn'}" for c, m in PAIRS])
def pair(request, tmp_path_factory):
    """(case, model_type, peft's model with random adapters, ours with the same adapters read from peft's folder)."""
    case, mlp = request.param
    model_type = CASES[case][0]
    folder = tmp_path_factory.mktemp(case)
    hf = build(case, noise=NOISE)
    hf.save_pretrained(folder / "base")
    ours = lora.add_lora(loading.load(folder / "base").model.eval(), RANK, alpha=ALPHA, mlp=mlp, family=model_type)
    theirs = _peft_model(hf, case, mlp)
    _randomised(theirs, 1)
    theirs.save_pretrained(folder / "adapter")
    lora.load_peft(ours, folder / "adapter", model_type)
    return case, model_type, theirs, ours


def test_logits_and_every_adapters_gradient_equal_peft(pair):
    case, model_type, theirs, ours = pair
    idx, targets = tokens(2, T, 1), tokens(2, T, 2)
    expected = theirs(input_ids=idx).logits
    F.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    got = ours(idx)[0]
    F.cross_entropy(got.flatten(0, 1), targets.flatten()).backward()
    with torch.no_grad(), theirs.disable_adapter():
        base = theirs(input_ids=idx).logits
    logit_error = _relative(got, expected)
    assert _relative(base, expected) > 1e-2  # the adapters matter: a tolerance that means something
    theirs_grads, ours_grads = _theirs_grads(theirs), _ours_grads(ours, model_type)
    assert ours_grads.keys() == theirs_grads.keys() and theirs_grads
    largest = max(g.abs().amax() for g in theirs_grads.values())
    grad_error = (max((ours_grads[k] - g).abs().amax() for k, g in theirs_grads.items()) / largest).item()
    print(f"{case}: logits {logit_error:.1e}, adapter gradients {grad_error:.1e} of the largest magnitude")
    assert logit_error < 1e-5 and grad_error < 1e-5


def test_dropout_draws_a_mask_per_part_as_peft_does():
    case, model_type = "llama-llama3-rope", "llama"
    hf = build(case, noise=NOISE)
    ours = lora.add_lora(_loaded(hf), RANK, alpha=ALPHA, dropout=0.25, mlp=True, family=model_type)
    theirs = _peft_model(hf, case, True, dropout=0.25)
    _randomised(theirs, 3)
    state = {n.replace(".default.", "."): p.detach() for n, p in theirs.named_parameters() if "lora_" in n}
    lora.load_adapter_state(ours, from_peft(state, _parts(ours), ours.config, model_type))
    idx = tokens(2, T, 4)
    with torch.no_grad():  # in eval mode no dropout: ours follow the model's mode, peft's start in training mode
        assert _relative(ours(idx)[0], theirs.eval()(input_ids=idx).logits) < 1e-5
    for m in [*lora.lora_modules(ours).values(), *(m for n, m in theirs.named_modules() if n.endswith("lora_dropout"))]:
        m.train()  # the adapters' dropouts alone: the same draws, in the same order, for the same shapes
    torch.manual_seed(5)
    expected = theirs(input_ids=idx).logits
    torch.manual_seed(5)
    got = ours(idx)[0]
    torch.manual_seed(6)
    other = ours(idx)[0]
    print(f"dropout 0.25: logits {_relative(got, expected):.1e} of the largest magnitude")
    assert _relative(got, expected) < 1e-5 and _relative(other, expected) > 1e-3  # other masks: other logits


def _loaded(hf) -> GPT:
    """Our GPT of the transformers model ``hf``, through a folder as every user's goes."""
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        return loading.load(folder).model.eval()


def test_only_the_adapters_train():
    model = lora.add_lora(scrambled(small(**VARIANTS["llama-shaped"])), 2, mlp=True)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    adapters = {p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 4 * model.config.n_layer  # A and B of qkv, proj, gate_up_proj, down_proj
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert {p for group in optimizer.param_groups for p in group["params"]} == adapters
    idx = torch.randint(0, model.config.vocab_size, (2, 12))
    model(idx, idx)[1].backward()
    assert all((p.grad is not None) == (p in adapters) for p in model.parameters())
    optimizer.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert not torch.equal(after["blocks.0.attn.qkv.lora_B"], torch.zeros_like(after["blocks.0.attn.qkv.lora_B"]))


@pytest.mark.parametrize("variant", ["llama-shaped", "bloom-shaped"])
def test_merge_gives_a_plain_gpt_of_the_same_logits(variant):
    model = lora.add_lora(scrambled(small(**VARIANTS[variant])), 4, alpha=6, mlp=True)
    _randomised(model, 7, names=("lora_A", "lora_B"))
    idx = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        expected, base = model(idx)[0], _without_adapters(model)(idx)[0]
        got = lora.merge(model)(idx)[0]
    print(f"{variant}: merged logits {_relative(got, expected):.1e} of the largest magnitude")
    assert _relative(got, expected) < 1e-5 and _relative(base, expected) > 1e-2
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}  # no LoRALinear left
    assert model.state_dict().keys() == GPT(model.config).state_dict().keys()
    assert all(p.requires_grad for p in model.parameters())


def _without_adapters(model: GPT) -> GPT:
    """A copy of ``model`` whose adapters are zero: its base alone."""
    plain = copy.deepcopy(model)
    lora.load_adapter_state(plain, {k: torch.zeros_like(v) for k, v in lora.adapter_state(plain).items()})
    return plain


@pytest.mark.parametrize("case", ["llama-llama3-rope", "phi3", "bloom"])
def test_a_folder_we_write_loads_in_peft_with_our_logits(case, tmp_path):
    model_type, attn, mlp_targets = CASES[case]
    ours = lora.add_lora(_loaded(build(case, noise=NOISE)), RANK, alpha=ALPHA, mlp=True, family=model_type)
    _randomised(ours, 8, names=("lora_A", "lora_B"))
    folder = lora.save_peft(ours, tmp_path / "adapter", model_type, base_model="tiny-" + case)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == RANK
    assert config["lora_alpha"] == ALPHA and config["base_model_name_or_path"] == "tiny-" + case
    assert sorted(config["target_modules"]) == sorted(attn + mlp_targets)
    theirs = peft.PeftModel.from_pretrained(build(case, noise=NOISE), folder)
    idx = tokens(2, T, 9)
    with torch.no_grad():
        expected, got = theirs(input_ids=idx).logits, ours(idx)[0]
    error = (got - expected).abs().amax().item()
    print(f"{case}: logits of our folder in peft within {error:.1e}")
    assert error < 1e-4
    back = lora.add_lora(_loaded(build(case, noise=NOISE)), RANK, alpha=ALPHA, mlp=True, family=model_type)
    lora.load_peft(back, folder, model_type)  # and back: the same tensors
    assert all(torch.equal(v, lora.adapter_state(back)[k]) for k, v in lora.adapter_state(ours).items())


def test_folders_that_do_not_fit_the_model_are_refused(tmp_path):
    ours = lora.add_lora(GPT(small(**VARIANTS["llama-shaped"])), 2)  # no family: q, k, v apart
    with pytest.raises(ValueError, match=r"phi3 names blocks\.0\.attn\.qkv as 1 modules but its adapters have 3 "
                                         r"parts: add_lora\(\.\.\., family='phi3'\)"):
        lora.save_peft(ours, tmp_path, "phi3", base_model="x")
    lora.save_peft(ours, tmp_path, "llama", base_model="x")  # control: llama names them apart
    other = lora.add_lora(GPT(small(**VARIANTS["llama-shaped"])), 4)
    with pytest.raises(ValueError, match="rank 2 and alpha 4.0, but this model's have rank 4 and alpha 8"):
        lora.load_peft(other, tmp_path, "llama")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(ValueError, match=r"adapter_config\.json: \{'use_rslora': True\}; only plain LoRA"):
        lora.load_peft(ours, tmp_path, "llama")  # its scale would be alpha / sqrt(rank)


@pytest.mark.parametrize("kw, error, match", [
    (dict(rank=0), ValueError, "rank must be a positive int, got 0"),
    (dict(rank=33), ValueError, r"rank=33 is larger than blocks\.0\.attn\.qkv allows: min\(in_features=32, "
                                r"smallest part=32 rows\) = 32"),
    (dict(rank=2.0), TypeError, "rank must be an int, got float 2.0"),
    (dict(rank=2, alpha=0), ValueError, "alpha must be a finite number > 0, got 0"),
    (dict(rank=2, alpha=-1.5), ValueError, r"alpha must be a finite number > 0, got -1\.5"),
    (dict(rank=2, dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1\.0"),
    (dict(rank=2, family="gpt_neox"), ValueError, "unknown family 'gpt_neox'"),
])
def test_bad_settings_are_refused_naming_the_value_and_change_nothing(kw, error, match):
    model = GPT(small(**VARIANTS["llama-shaped"]))  # C = 32, k and v 2 heads of 16 rows: rank 32 at most
    with pytest.raises(error, match=match):
        lora.add_lora(model, **kw)
    assert not lora.lora_modules(model) and all(p.requires_grad for p in model.parameters())
    lora.add_lora(model, 32)  # control: the largest rank it takes
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.add_lora(model, 2)


def test_settings_and_adapter_state_rebuild_the_model_a_checkpoint_saved():
    model = lora.add_lora(scrambled(small(**VARIANTS["llama-shaped"])), 3, alpha=5, dropout=0.1, mlp=True,
                          family="qwen2")
    _randomised(model, 10, names=("lora_A", "lora_B"))
    settings = json.loads(json.dumps(lora.lora_settings(model)))
    assert settings == dict(rank=3, alpha=5.0, dropout=0.1, family="qwen2", mlp=True)
    base = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    rebuilt = lora.add_lora(GPT(model.config), **settings)
    rebuilt.load_state_dict(base, strict=False)
    lora.load_adapter_state(rebuilt, lora.adapter_state(model))
    idx = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(idx)[0], model.eval()(idx)[0])
    state = lora.adapter_state(model)
    with pytest.raises(ValueError, match=r"missing 1 tensor: blocks\.1\.mlp\.down_proj\.lora_B; of another shape "
                                         r"1 tensor: blocks\.0\.attn\.qkv\.lora_A \(3, 32\) instead of \(9, 32\)"):
        lora.load_adapter_state(rebuilt, {**{k: v for k, v in state.items() if k != "blocks.1.mlp.down_proj.lora_B"},
                                          "blocks.0.attn.qkv.lora_A": torch.zeros(3, 32)})


def test_a_mixture_of_experts_takes_adapters_on_its_attention_only():
    model = GPT(small(**VARIANTS["post-norm-experts-sinks"]))
    with pytest.raises(ValueError, match="mlp=True needs linear MLPs, but this model's MLP is moe"):
        lora.add_lora(model, 2, mlp=True)
    assert not lora.lora_modules(model)
    lora.add_lora(model, 2)
    assert list(lora.lora_modules(model)) == [f"blocks.{i}.attn.{n}" for i in range(2) for n in ("qkv", "proj")]
    assert lora.lora_settings(model) == dict(rank=2, alpha=4.0, dropout=0.0, family=None, mlp=False)


def test_the_base_digest_covers_the_base_and_not_the_adapters():
    model = GPT(small(**VARIANTS["llama-shaped"]))
    before = lora.base_digest(model)
    lora.add_lora(model, 2, mlp=True)
    assert lora.base_digest(model) == before  # the same base under adapters
    _randomised(model, 9, names=("lora_A", "lora_B"))
    assert lora.base_digest(model) == before  # negative control: adapters are not the base
    w = model.blocks[1].mlp.down_proj.weight
    with torch.no_grad():
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))  # one ulp
    assert lora.base_digest(model) != before
