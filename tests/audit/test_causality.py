"""The causality auditor: broken modules are caught with the right first leak, correct ones pass.

Negative controls are the point: every way a sequence module can see its future that we
know of (no mask, a mask after the softmax, off-by-one masks, leaks outside attention) is
built here and must be caught, naming the first leaking (output, input) pair.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn import KVCache, SelfAttention, self_attention
from selfattn.audit import check_cache, check_causal, hf_adapter
from selfattn.backends import tiled
from selfattn.config import GPTConfig
from selfattn.generation import generate
from selfattn.masks import Mask
from selfattn.model import GPT

C, T = 8, 7


def example(B=2, T=T, C=C):
    return torch.randn(B, T, C)


class OneHead(nn.Module):
    """One attention head ``(B, T, C) -> (B, T, C)``; subclasses change ``weights`` (or the
    whole forward) to build the broken variants."""

    def __init__(self, width: int = C):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, C) each
        s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # (B, T, S)
        return self.weights(s) @ v  # (B, T, C)

    def weights(self, s):
        T, S = s.shape[-2:]
        allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)  # bottom-right: correct
        return s.masked_fill(~allowed, float("-inf")).softmax(-1)


class NoMask(OneHead):
    def weights(self, s):
        return s.softmax(-1)


class MaskAfterSoftmax(OneHead):
    """Softmax over every key, then the future zeroed and nothing renormalised: the row's
    normaliser still sums exp(score) over future keys, so the past weights move with them.
    (Renormalising after the mask would cancel that normaliser exactly, up to rounding.)"""

    def weights(self, s):
        return s.softmax(-1) * torch.ones(s.shape[-2:]).tril()


class DropsDiagonal(OneHead):
    """``tril(diagonal=-1)``: each position sees only strictly earlier ones, so row 0 sees
    nothing. With a -inf fill that row is 0/0 = NaN; with a finite fill (-1e9, as older code
    does) every entry of row 0 is equal and it averages over the *whole* sequence."""

    def __init__(self, fill: float):
        super().__init__()
        self.fill = fill

    def weights(self, s):
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril(diagonal=-1)
        return s.masked_fill(~allowed, self.fill).softmax(-1)


class SeesNext(OneHead):
    def weights(self, s):  # tril(diagonal=1): i sees i + 1
        return s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(diagonal=1), float("-inf")).softmax(-1)


class WindowTooWide(OneHead):
    """A window of W that keeps ``j >= i - W`` instead of ``j > i - W``: W + 1 keys."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def weights(self, s):
        i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        return s.masked_fill(~((j <= i) & (j >= i - self.window)), float("-inf")).softmax(-1)


class TopLeftPrefix(OneHead):
    """Attends over a cached prefix plus the T new positions (S = P + T); the causal mask is
    aligned top-left (query i sees keys 0..i) instead of bottom-right (keys 0..P + i)."""

    def __init__(self, prefix_len: int, top_left: bool):
        super().__init__()
        self.prefix = torch.randn(2, prefix_len, C)
        self.top_left = top_left

    def forward(self, x):
        q = self.qkv(x).chunk(3, dim=-1)[0]  # (B, T, C)
        k, v = self.qkv(torch.cat([self.prefix, x], dim=1)).chunk(3, dim=-1)[1:]  # (B, S, C) each
        s = q @ k.transpose(1, 2) * C ** -0.5  # (B, T, S)
        T, S = s.shape[-2:]
        allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=0 if self.top_left else S - T)
        return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v  # (B, T, C)


class MeanOverTime(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)  # centring uses every position


class NormOverTime(nn.Module):
    """LayerNorm across the T axis: normalises each channel over the sequence, at eval too."""

    def __init__(self, T: int = T):
        super().__init__()
        self.norm = nn.LayerNorm(T)

    def forward(self, x):
        return self.norm(x.transpose(1, 2)).transpose(1, 2)  # (B, C, T) normalised over T -> (B, T, C)


class BatchNormOverTime(nn.Module):
    """BatchNorm1d over (B, C, T): per-channel statistics over batch *and* time."""

    def __init__(self, track_running_stats: bool):
        super().__init__()
        self.bn = nn.BatchNorm1d(C, track_running_stats=track_running_stats)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)  # (B, C, T) -> (B, T, C)


class Conv(nn.Module):
    """A width-3 convolution along time, padded on the left (causal) or on the right."""

    def __init__(self, pad_left: bool):
        super().__init__()
        self.conv = nn.Conv1d(C, C, kernel_size=3)
        self.pad = (2, 0) if pad_left else (0, 2)

    def forward(self, x):
        return self.conv(F.pad(x.transpose(1, 2), self.pad)).transpose(1, 2)  # (B, C, T + 2) -> (B, T, C)


def upper(T, offset=1):
    """Every pair (i, j) with j >= i + offset, in row-major order."""
    return {(i, j) for i in range(T) for j in range(i + offset, T)}


def pairs(report, method):
    return {(k.output, k.input) for k in report.leaks if k.method == method}


# --- negative controls: each broken module is caught, its first leak named --------------------

BROKEN = {  # name -> (the broken module, every (output, input) pair it leaks for T positions)
    "no mask": (NoMask, upper(T)),
    "mask after softmax": (MaskAfterSoftmax, upper(T)),
    "diagonal dropped, finite fill": (lambda: DropsDiagonal(fill=-1e9), {(0, j) for j in range(1, T)}),  # row 0 only
    "i sees i+1": (SeesNext, {(i, i + 1) for i in range(T - 1)}),
    "mean over time": (MeanOverTime, upper(T)),
    "layernorm over time": (NormOverTime, upper(T)),
    "batchnorm, batch statistics": (lambda: BatchNormOverTime(track_running_stats=False), upper(T)),
    "conv padded on the right": (lambda: Conv(pad_left=False), upper(T) - upper(T, 3)),  # sees i + 1 and i + 2
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_modules_are_caught_with_the_first_leak_named(name):
    build, expected = BROKEN[name]
    report = check_causal(build(), example())
    assert not report.ok
    assert report.first_leak[:2] == (0, 1)  # output 0 sees input 1: the earliest leak there is
    assert "LEAK" in str(report) and "first leak: output 0 depends on input 1" in str(report)
    for method in ("perturb", "jacobian"):
        assert pairs(report, method) == expected, method
        assert report.max_leak[method] > 1e-4


def test_leaks_are_sorted_largest_first_within_each_method():
    report = check_causal(NoMask(), example())
    n = T * (T - 1) // 2
    assert [k.method for k in report.leaks] == ["perturb"] * n + ["jacobian"] * n
    for method in ("perturb", "jacobian"):
        sizes = [k.size for k in report.leaks if k.method == method]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0


def test_mask_dropping_the_diagonal_with_minus_inf_gives_a_nan_row():
    report = check_causal(DropsDiagonal(fill=float("-inf")), example())
    assert not report.ok and report.nonfinite == (0,) and not report.leaks
    assert "NON-FINITE" in str(report) and "non-finite outputs at positions [0]" in str(report)
    assert "    0 ???????" in str(report)  # the NaN row of the picture


def test_window_off_by_one_is_caught_given_the_window():
    W = 3
    wide = check_causal(WindowTooWide(W), example(), window=W)
    assert wide.first_leak[:2] == (W, 0)  # output W sees input 0, one older than its window
    assert pairs(wide, "perturb") == pairs(wide, "jacobian") == {(i, i - W) for i in range(W, T)}
    assert check_causal(WindowTooWide(W), example()).ok  # seeing too far back is still causal
    right = check_causal(SelfAttention(C, 2, window=W), example(), window=W)
    assert right.ok and right.dependence["jacobian"][W, 1] > 0 and right.dependence["jacobian"][W, 0] == 0


def test_top_left_alignment_hides_the_past_and_is_no_leak():
    """Top-left alignment under a cache (T < S) is wrong, but it hides keys instead of showing
    future ones: the auditor reports no leak and the holes show in the dependence matrix (the
    cache check below catches the same bug in a GPT)."""
    P = 3
    right, wrong = (check_causal(TopLeftPrefix(P, top_left), example()) for top_left in (False, True))
    assert right.ok and wrong.ok
    dep_right, dep_wrong = right.dependence["jacobian"], wrong.dependence["jacobian"]
    past = torch.ones(T, T, dtype=torch.bool).tril()
    assert (dep_right[past] > 0).all()  # bottom-right: every output sees every new input up to itself
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (j <= i - P) | ((j == i) & (i > 0))  # new keys 0..i - P, and its own query (row 0 sees one key: constant)
    assert torch.equal(dep_wrong > 0, seen)


def test_eval_mode_batchnorm_is_not_a_leak_and_nothing_changes():
    """The auditor audits inference: BatchNorm on its running statistics is per position
    (its training-mode batch statistics would leak, and are out of scope)."""
    module = BatchNormOverTime(track_running_stats=True).train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    report = check_causal(module, example() * 3 + 1)
    assert report.ok and module.training and module.bn.training
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # running stats untouched


# --- correct modules pass ----------------------------------------------------------------------

OPTIONS = {"plain": {}, "gqa": {"n_kv_head": 2}, "window": {"window": 3}, "rope": {"rope": True},
           "gqa+rope+window": {"n_kv_head": 1, "rope": True, "window": 2}}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 2 queries x 4 keys, so T = 10 spans hidden, partly hidden and full tiles."""
    monkeypatch.setattr(tiled, "run", functools.partial(tiled.run, block_q=2, block_k=4))


@pytest.mark.parametrize("backend", ["math", "sdpa", "tiled"])
@pytest.mark.parametrize("option", OPTIONS)
def test_our_attention_passes_every_backend_and_option(backend, option, small_tiles):
    kwargs = OPTIONS[option]
    attn = SelfAttention(16, 4, backend=backend, **kwargs)
    report = check_causal(attn, example(T=10, C=16), window=kwargs.get("window"))
    assert report.ok and not report.dead, str(report)
    assert report.max_leak == {"perturb": 0.0, "jacobian": 0.0}
    for dep in report.dependence.values():  # and it depends on everything it may see
        allowed = Mask(window=kwargs.get("window")).dense(10, 10)[0, 0]
        assert (dep[allowed] > 0).all()


@pytest.mark.parametrize("backend", ["math", "sdpa", "tiled"])
def test_padding_and_documents_pass_and_padding_is_dead(backend, small_tiles):
    attn = SelfAttention(16, 4, backend=backend)
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[:, :3] = False  # three left-padding positions in both rows
    padded = check_causal(lambda x: attn(x, key_padding_mask=pad), example(T=10, C=16))
    assert padded.ok and padded.dead == (0, 1, 2)
    docs = torch.tensor([0] * 4 + [1] * 6).expand(2, 10)  # (B, S) two packed documents
    packed = check_causal(lambda x: attn(x, doc_ids=docs), example(T=10, C=16))
    assert packed.ok and packed.dependence["jacobian"][5, 3] == 0 and packed.dependence["jacobian"][5, 4] > 0


def test_causal_convolution_passes():
    assert check_causal(Conv(pad_left=True), example()).ok


@pytest.mark.parametrize("config", [{}, {"pos": "rope", "n_kv_head": 1, "window": 3, "backend": "math"}])
def test_tiny_gpt_passes_on_token_ids(config):
    gpt = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, **config))
    report = check_causal(gpt, torch.randint(0, 32, (2, 9)))
    assert report.ok and not report.dead, str(report)
    assert (report.dependence["jacobian"].tril().diagonal() > 0).all()


def test_gpt_with_a_leaking_attention_is_caught(monkeypatch):
    """The model-level audit sees through the layers: patch the attention to drop its mask."""
    gpt = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    monkeypatch.setattr(self_attention, "attention",
                        lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v))
    report = check_causal(gpt, torch.randint(0, 32, (1, 6)))
    assert report.first_leak[:2] == (0, 1) and pairs(report, "jacobian") == upper(6)


def test_hugging_face_causal_lm_through_the_adapter(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    report = check_causal(hf_adapter(model), torch.randint(0, 32, (2, 6)))
    assert report.ok and not report.dead, str(report)
    assert next(model.parameters()).dtype == torch.float32  # the float64 jacobian ran on a copy


# --- the report and the auditor's own behaviour ----------------------------------------------------

def test_report_picture_marks_leaks_where_they_are():
    text = str(check_causal(SeesNext(), example(T=4)))
    assert "\n      0123\n    0 █!..\n    1 ██!.\n    2 ███!\n    3 ████" in text


def test_positions_restrict_the_checked_inputs():
    report = check_causal(NoMask(), example(), positions=[4, 2])
    assert report.positions == (2, 4)
    assert {k.input for k in report.leaks} == {2, 4}
    assert report.dependence["perturb"][:, 0].isnan().all() and "\n    0   ! !  \n" in str(report)


def test_atol_forgives_small_dependence():
    module = MaskAfterSoftmax()
    x = example()
    report = check_causal(module, x, method="perturb")
    assert not check_causal(module, x, method="perturb", atol=report.max_leak["perturb"] * 0.99).ok
    assert check_causal(module, x, method="perturb", atol=report.max_leak["perturb"]).ok


def test_runs_in_eval_mode_restores_modes_and_changes_no_parameter():
    seen = []

    class Probe(OneHead):
        def forward(self, x):
            seen.append((self.training, self.drop.training))
            return self.drop(super().forward(x))

    module = Probe()
    module.drop = nn.Dropout(0.5)
    module.train()
    module.drop.eval()  # a submodule in another mode than its parent keeps its own mode
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert check_causal(module, example()).ok  # dropout would make perturb see noise everywhere
    assert set(seen) == {(False, False)}
    assert module.training and not module.drop.training
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in module.state_dict().items())


def test_dead_positions_are_reported():
    class IgnoresOdd(nn.Module):
        def forward(self, x):
            return x * (torch.arange(x.shape[1]) % 2 == 0)[None, :, None]  # odd positions zeroed

    report = check_causal(IgnoresOdd(), example())
    assert report.ok and report.dead == (1, 3, 5)
    assert "dead inputs (changing them moved nothing): [1, 3, 5]" in str(report)


def test_token_ids_need_an_embedding_for_the_jacobian():
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mix = nn.Embedding(10, 4), NoMask(4)

        def forward(self, idx):
            return self.mix(self.emb(idx))

    model, ids = Tokens(), torch.randint(0, 10, (1, 5))
    with pytest.raises(TypeError, match="input embedding"):
        check_causal(model, ids)
    assert check_causal(model, ids, method="perturb").first_leak[:2] == (0, 1)
    assert check_causal(model, ids, embedding=model.emb).first_leak[:2] == (0, 1)
    with pytest.raises(ValueError, match="submodule"):
        check_causal(model, ids, embedding=nn.Embedding(10, 4))


def test_plain_callables_and_tuple_outputs():
    w = torch.randn(C, C, dtype=torch.float64)
    assert check_causal(lambda x: (x.cumsum(1) @ w.to(x.dtype), None), example()).ok
    assert check_causal(lambda x: x.flip(1), example()).first_leak[:2] == (0, T - 1)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"method": "grad"}, ValueError, ["'grad'", "perturb"]),
    ({"positions": [0, 7]}, ValueError, ["T=7", "[7]"]),
    ({"positions": []}, ValueError, ["positions"]),
    ({"atol": -1.0}, ValueError, ["atol", "-1.0"]),
    ({"window": 0}, ValueError, ["window", "0"]),
])
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        check_causal(NoMask(), example(), **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("fn,x,error,words", [
    (lambda x: x[:, :-1], example(), ValueError, ["same-length", "(2, 6, 8)"]),
    (lambda x: "y", example(), TypeError, ["str"]),
    (NoMask(), [[1.0]], TypeError, ["list"]),
    (NoMask(), torch.randn(7), ValueError, ["(7,)"]),
    (NoMask(), torch.ones(2, 3, dtype=torch.bool), TypeError, ["bool"]),
])
def test_bad_functions_and_examples(fn, x, error, words):
    with pytest.raises(error) as info:
        check_causal(fn, x)
    assert all(w in str(info.value) for w in words), str(info.value)


# --- cached decoding against the full forward --------------------------------------------------------

def tiny_gpt(**config):
    return GPT(GPTConfig(vocab_size=32, block_size=24, n_layer=3, n_head=2, n_embd=16, **config))


@pytest.mark.parametrize("config", [{}, {"pos": "rope", "n_kv_head": 1, "window": 4}])
def test_cache_agrees_with_the_full_forward(config):
    gpt, prompt = tiny_gpt(dropout=0.2, **config).train(), torch.randint(0, 32, (2, 5))  # dropout: eval is a must
    report = check_cache(gpt, prompt, 8)
    assert report.ok and report.first_step is None and report.first_layer is None, str(report)
    assert report.errors.shape == (8, 5) and report.bounds.shape == (5,)
    assert (report.bounds >= 16 * torch.finfo(torch.float32).eps * 3).all() and report.rtol < 1e-4  # a bug errs by 1e-2
    assert report.layers == ("embeddings", "block 0", "block 1", "block 2", "logits")
    assert gpt.training
    greedy = torch.stack(list(generate(gpt.eval(), prompt, 8, temperature=0.0)), dim=1)
    assert torch.equal(report.tokens, greedy)


def stale_slot(decode_only: bool):
    """KVCache.append that hands back one slot past the live ones (a stale, never-written slot)."""
    append = KVCache.append

    def broken(self, k, v):
        k_all, v_all = append(self, k, v)
        if (decode_only and k.shape[2] > 1) or self.length == self.max_len:
            return k_all, v_all
        return self.k[:, :, :self.length + 1], self.v[:, :, :self.length + 1]  # (B, Hkv, S + 1, D)
    return broken


@pytest.mark.parametrize("decode_only,step", [(True, 1), (False, 0)])
def test_cache_with_a_stale_slot_is_caught(monkeypatch, decode_only, step):
    monkeypatch.setattr(KVCache, "append", stale_slot(decode_only))
    report = check_cache(tiny_gpt(), torch.randint(0, 32, (2, 5)), 6)
    assert not report.ok and (report.first_step, report.first_layer) == (step, "block 0")
    assert (report.errors[:step] <= report.rtol).all()
    assert report.errors[step, 0] <= report.rtol < report.errors[step, 1]  # embeddings agree, block 0 does not
    assert f"DIVERGES at step {step}, block 0" in str(report)


def test_cache_with_top_left_alignment_is_caught(monkeypatch):
    """``is_causal=True`` with a cache: PyTorch aligns it top-left, so the decoded token's query
    sees only key 0. The prefill (T == S) is right; the first decode step is not."""
    monkeypatch.setattr(self_attention, "attention",
                        lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    report = check_cache(tiny_gpt(), torch.randint(0, 32, (2, 5)), 4)
    assert (report.first_step, report.first_layer) == (1, "block 0")
    assert report.errors[0].max() <= report.rtol


def test_a_model_whose_outputs_are_not_finite_fails_the_cache_check():
    gpt = tiny_gpt()
    prompt = torch.randint(0, 32, (2, 5))
    assert check_cache(gpt, prompt, 3).ok  # control: the same model, finite
    with torch.no_grad():
        gpt.blocks[1].mlp.c_fc.weight[0, 0] = float("nan")
    report = check_cache(gpt, prompt, 3)
    assert not report.ok and (report.first_step, report.first_layer) == (0, "block 1"), str(report)
    assert "DIVERGES" in str(report)


def test_cache_check_arguments():
    gpt = tiny_gpt()
    with pytest.raises(TypeError, match="new_cache"):
        check_cache(NoMask(), torch.zeros(1, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        check_cache(gpt, torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_cache(gpt, torch.zeros(1, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="block_size=24"):
        check_cache(gpt, torch.zeros(1, 20, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="rtol"):
        check_cache(gpt, torch.zeros(1, 3, dtype=torch.long), 2, rtol=-1.0)


# --- declared rules beyond causality: prefix-LM and sink tokens ------------------------------------

def _prefix_module(prefix):
    from selfattn import SelfAttention

    attn = SelfAttention(16, 2, backend="math")

    class Prefixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, prefix_len=prefix)
    return Prefixed()


def test_a_prefix_lm_passes_exactly_its_declared_prefix_and_fails_one_off():
    x = torch.randn(2, 10, 16)
    assert check_causal(_prefix_module(4), x, prefix_len=4).ok  # bidirectional inside the prefix, by design
    report = check_causal(_prefix_module(4), x)  # declared plain causal: the prefix is a leak
    assert not report.ok and report.first_leak[:2] == (0, 1)
    off = check_causal(_prefix_module(5), x, prefix_len=4)  # negative control: a prefix one too long
    assert not off.ok and {(leak.output, leak.input) for leak in off.leaks} == {(i, 4) for i in range(4)}


def test_sink_tokens_pass_exactly_their_declared_window_and_fail_one_off():
    from selfattn import SelfAttention

    x = torch.randn(2, 12, 16)
    sinks2 = SelfAttention(16, 2, window=3, sink_tokens=2, backend="math")
    assert check_causal(sinks2, x, window=3, sink_tokens=2).ok
    off = check_causal(sinks2, x, window=3, sink_tokens=1)  # negative control: one sink fewer declared
    assert not off.ok and all(leak.input == 1 for leak in off.leaks)
    wider = SelfAttention(16, 2, window=4, sink_tokens=2, backend="math")  # negative control: the window off by one
    assert not check_causal(wider, x, window=3, sink_tokens=2).ok
