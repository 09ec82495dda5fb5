"""TransformerLens 4.3 is the oracle of the sites: its ``TransformerBridge`` on the same folder (compatibility mode,
no weight processing, each head's result on) holds the same tensors under the same names and shapes, within
1e-4 of the site's largest value (float32), on every family its bridge loads, which is all of them.

One declared difference: BLOOM's ``hook_attn_scores``. ``transformers`` (and so the bridge) adds ALiBi as
``slope · j`` for key j, this library as ``-slope · (i - j)`` (the paper's form); the two differ by ``slope · i``
along each query's row, a constant the softmax ignores, so the patterns are equal and the scores are compared up
to that constant.
"""
import torch

from selfattn.interp import run_with_cache

from helpers.families import V, tokens

# sites every family must share with TransformerLens (the test compares something)
ALWAYS = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.attn.hook_k",
          "blocks.0.attn.hook_v", "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern",
          "blocks.0.attn.hook_z", "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out",
          "blocks.1.hook_resid_post", "ln_final.hook_scale", "ln_final.hook_normalized"]


def bridge(folder):
    from tokenizers import Tokenizer, models
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)},
                                                                                unk_token="t0")))
    model = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32, tokenizer=words)
    model.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    model.set_use_attn_result(True)
    return model


def test_every_common_site_equals_transformer_lens(family):
    name, folder, ours = family
    idx = tokens(2, 24, 6)  # longer than the sliding layers' window
    with torch.no_grad():
        _, theirs = bridge(folder).run_with_cache(idx)
        _, mine = run_with_cache(ours, idx)
    common = [n for n in mine if n in theirs]
    required = set(ALWAYS) - ({"blocks.0.hook_attn_out"} if name == "bloom" else set())  # its bridge drops it
    assert required <= set(common), sorted(required - set(common))  # with each head's result on
    worst, where = 0.0, None
    for site in common:
        a, t = mine[site].double(), theirs[site].double()
        assert a.shape == t.shape, (site, tuple(a.shape), tuple(t.shape))
        hidden = torch.isinf(t)
        assert torch.equal(hidden, torch.isinf(a)), site  # the same pairs masked (scores at -inf)
        diff = (a - t).masked_fill(hidden, 0)
        if name == "bloom" and site.endswith("hook_attn_scores"):  # ALiBi's form, see the module docstring
            diff = (diff - diff[..., :1]).masked_fill(hidden, 0)
        error = (diff.abs().amax() / t.masked_fill(hidden, 0).abs().amax().clamp(min=1)).item()
        if error > worst:
            worst, where = error, site
    print(f"{name}: {len(common)} sites in common, largest difference {worst:.1e} of the site's scale ({where})")
    assert worst < 1e-4


def test_the_comparison_sees_a_difference(tmp_path):  # negative control: one perturbed site shows
    from selfattn.interp import hooks
    from selfattn.io import loading

    from helpers.gpt2 import gpt2_folder

    folder = gpt2_folder(tmp_path, n_layer=2, n_head=4, n_embd=64)
    ours, idx = loading.load(folder).model.eval(), tokens(1, 8, 7)
    with torch.no_grad(), hooks(ours, {"blocks.1.attn.hook_v": lambda t, n: t * 1.001}):
        _, mine = run_with_cache(ours, idx)
        _, theirs = bridge(folder).run_with_cache(idx)
    assert (mine["blocks.1.attn.hook_z"] - theirs["blocks.1.attn.hook_z"]).abs().amax() > 1e-5
