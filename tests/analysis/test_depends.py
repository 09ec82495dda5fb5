"""What the attention page's "depends on" section holds (selfattn.analysis.depends): each head's and each input
position's share of the predicted token's logit, as a forward with that one patch gives it."""
import json
import re

import torch

from selfattn.analysis.depends import MAX_TOKENS, depends_on, shuffled
from selfattn.analysis.explore import explore
from selfattn.interp import hooks, run_with_cache

from helpers.gemma3 import gemma3
from helpers.models import scrambled, small


def page_data(path) -> dict:
    """The JSON the page at ``path`` carries."""
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', path.read_text(),
                                flags=re.S).group(1))


def _model():
    return scrambled(small(pos="rope", n_kv_head=2)).eval()


def _share(model, idx, corrupt, token, site, patch_fn) -> float:
    """The share a forward of ``corrupt`` with ``patch_fn`` at ``site`` restores of the clean logit of ``token``."""
    with torch.no_grad():
        clean = float(model(idx[None])[0][0, -1, token])
        bad = float(model(corrupt[None])[0][0, -1, token])
        with hooks(model, {site: patch_fn}):
            patched = float(model(corrupt[None])[0][0, -1, token])
    return (patched - bad) / (clean - bad)


def test_each_share_is_a_forward_with_that_one_patch():
    model = _model()
    idx = torch.randint(0, 61, (9,), generator=torch.Generator().manual_seed(1))
    corrupt = idx.clone()
    corrupt[2], corrupt[5] = (corrupt[2] + 1) % 61, (corrupt[5] + 7) % 61
    got = depends_on(model, idx, corrupt)
    _, cache = run_with_cache(model, idx[None])
    for layer, head in [(0, 1), (1, 3)]:
        name = f"blocks.{layer}.attn.hook_z"

        def one_head(z, _, name=name, head=head):
            z = z.clone()
            z[:, :, head] = cache[name][:, :, head]  # (B, T, H, D): one head, every position
            return z
        expected = _share(model, idx, corrupt, got["token"], name, one_head)
        assert abs(got["heads"][layer][head] - expected) < 1e-3
    assert abs(got["heads"][0][1] - got["heads"][1][3]) > 1e-3  # the negative control: heads differ
    for position in (2, 5):
        def one_position(x, _, position=position):
            x = x.clone()
            x[:, position] = cache["blocks.0.hook_resid_pre"][:, position]
            return x
        expected = _share(model, idx, corrupt, got["token"], "blocks.0.hook_resid_pre", one_position)
        assert abs(got["positions"][position] - expected) < 1e-3
    assert [got["positions"][i] for i in (0, 1, 3, 4, 6, 7, 8)] == [0.0] * 7  # the same token there: nothing to patch
    assert got["corrupt_tokens"] == corrupt.tolist()


def test_the_default_corruption_is_the_input_shuffled_and_no_gap_is_said():
    model, idx = _model(), torch.arange(10, 22)
    got = depends_on(model, idx)
    assert got["corrupt_tokens"] == shuffled(idx).tolist() != idx.tolist()
    assert sorted(got["corrupt_tokens"]) == idx.tolist()
    same = depends_on(model, idx, idx)
    assert same["heads"] is None and same["positions"] is None and "no gap" in same["why"]


def test_a_page_of_a_long_input_says_why_it_has_no_such_section(tmp_path):
    model = scrambled(small(block_size=MAX_TOKENS + 8)).eval()
    explore(model, torch.randint(0, 61, (MAX_TOKENS + 1,)), tmp_path / "long.html")
    got = page_data(tmp_path / "long.html")["depends"]
    assert "heads" not in got and f"at most {MAX_TOKENS}" in got["why"]
    explore(model, torch.randint(0, 61, (MAX_TOKENS,)), tmp_path / "short.html")
    assert len(page_data(tmp_path / "short.html")["depends"]["positions"]) == MAX_TOKENS


def test_the_page_of_a_gguf_file_says_what_its_answer_depends_on(tmp_path):
    from selfattn.cli import main

    page = tmp_path / "page.html"
    assert main(["explore", "--ckpt", str(gemma3()), "--text", "<bos>The capital of France is",
                 "--corrupt", "<bos>The capital of Italy is", "--out", str(page)]) == 0
    got = page_data(page)["depends"]
    heads = torch.tensor(got["heads"])  # (L, H)
    assert heads.shape == (18, 4) and heads.argmax() == 12 * 4 + 2  # the recall head of docs/interp.md
    assert [i for i, share in enumerate(got["positions"]) if share != 0] == [4]  # " France", the one token changed
    assert got["clean"] > got["corrupt"]
