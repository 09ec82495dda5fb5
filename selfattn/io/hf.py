"""GPT-2 weights from and to Hugging Face ``transformers`` (optional extra ``hf``).

``from_hf(model)`` turns a ``GPT2LMHeadModel`` into our :class:`~selfattn.model.GPT`,
``to_hf(gpt)`` does the reverse, and ``load_gpt2(path)`` reads a directory written by
``save_pretrained`` from local disk (never from the network).

The architectures match module for module; the one trap is that GPT-2's ``Conv1D`` stores
its weight as ``(in, out)``, the transpose of ``nn.Linear``'s ``(out, in)``. GPT-2's
``"gelu_new"`` is the tanh approximation of GELU, its head is tied to the token embedding,
and its layers have biases (``GPTConfig(bias=True)``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from selfattn._util.validate import listed, one_line
from selfattn.config import GPTConfig
from selfattn.model import GPT

_GPT2_EOT = 50256  # GPT-2's <|endoftext|> token, its bos and eos
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF activation -> nn.GELU approximate


def from_hf(hf_model) -> GPT:
    """Our GPT with the weights, dtype, device and train/eval mode of a ``GPT2LMHeadModel``.

    Raises ValueError for GPT-2 variants this architecture cannot express.
    """
    transformers = _transformers()
    if not isinstance(hf_model, transformers.GPT2LMHeadModel):
        raise TypeError(f"from_hf expects a transformers GPT2LMHeadModel, got {type(hf_model).__name__}")
    c = hf_model.config
    unsupported = {"scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
                   "reorder_and_upcast_attn": c.reorder_and_upcast_attn,
                   "add_cross_attention": c.add_cross_attention,
                   "scale_attn_weights=False": not c.scale_attn_weights}
    if any(unsupported.values()):
        raise ValueError(f"unsupported GPT-2 config: {[k for k, on in unsupported.items() if on]}")
    if c.activation_function not in _GELU:
        raise ValueError(f"unsupported GPT-2 activation_function {c.activation_function!r}; "
                         f"supported: {sorted(_GELU)}")
    if c.n_inner not in (None, 4 * c.n_embd):
        raise ValueError(f"unsupported GPT-2 n_inner={c.n_inner}: the MLP width must be 4 * n_embd = {4 * c.n_embd}")
    if hf_model.lm_head.weight.data_ptr() != hf_model.transformer.wte.weight.data_ptr() and \
            not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight):
        raise ValueError("unsupported GPT-2 model: lm_head is not tied to the token embedding wte")
    drops = {"resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop}
    if len(set(drops.values())) != 1:
        raise ValueError(f"unsupported GPT-2 dropouts {drops}: GPTConfig has one dropout for all three")
    config = GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                       n_embd=c.n_embd, bias=True, dropout=float(c.resid_pdrop), pos="learned",
                       layer_norm_eps=c.layer_norm_epsilon, gelu_approximate=_GELU[c.activation_function])
    w = hf_model.transformer.wte.weight
    gpt = GPT(config).to(device=w.device, dtype=w.dtype)
    theirs = hf_model.state_dict()
    state = {ours: theirs[name].t() if transpose else theirs[name] for ours, name, transpose in _names(config.n_layer)}
    state["lm_head.weight"] = state["wte.weight"]  # tied; listed so the load can be strict
    gpt.load_state_dict(state)
    return gpt.train(hf_model.training)


def to_hf(gpt: GPT):
    """A ``transformers`` ``GPT2LMHeadModel`` with our GPT's weights, dtype, device and mode.

    Only GPT-2's architecture converts: learned positions, biases, LayerNorm, a GELU MLP of
    4 * n_embd, a tied head, full multi-head attention (no GQA, no window).
    """
    transformers = _transformers()
    if not isinstance(gpt, GPT):
        raise TypeError(f"to_hf expects a selfattn GPT, got {type(gpt).__name__}")
    cfg = gpt.config
    mismatch = {name: getattr(cfg, name) for name, ok in (
        ("pos", cfg.pos == "learned"), ("bias", cfg.bias), ("mlp", cfg.mlp),
        ("n_kv_head", cfg.n_kv_head in (None, cfg.n_head)), ("window", cfg.window is None), ("alibi", not cfg.alibi),
        ("softcap", cfg.softcap is None), ("sinks", not cfg.sinks), ("qkv_bias", cfg.qkv_bias is not False),
        ("proj_bias", cfg.proj_bias is not False), ("mlp_kind", cfg.mlp_kind == "gelu"),
        ("intermediate_size", cfg.intermediate_size in (None, 4 * cfg.n_embd)), ("norm", cfg.norm == "layernorm"),
        ("head_dim", cfg.head_dim in (None, cfg.n_embd // cfg.n_head)), ("tie_embeddings", cfg.tie_embeddings))
        if not ok}
    if mismatch:
        raise ValueError(f"only GPT-2's architecture converts to transformers (pos='learned', bias=True, mlp=True, "
                         f"LayerNorm, GELU MLP, tied head, no GQA, no window); this config has {mismatch}")
    eot = _GPT2_EOT if cfg.vocab_size > _GPT2_EOT else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    hf_config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, layer_norm_epsilon=cfg.layer_norm_eps,
        activation_function="gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=True,
        bos_token_id=eot, eos_token_id=eot)
    w = gpt.wte.weight
    hf_model = transformers.GPT2LMHeadModel(hf_config).to(device=w.device, dtype=w.dtype)
    ours = gpt.state_dict()
    with torch.no_grad():
        theirs = hf_model.state_dict()
        for mine, name, transpose in _names(cfg.n_layer):
            theirs[name].copy_(ours[mine].t() if transpose else ours[mine])
    return hf_model.train(gpt.training)


def _check_weights(folder: Path) -> None:
    """Open each weights file of ``folder`` (``model.safetensors``, or the shards its index names)
    and read its header, so that a damaged one is a ValueError naming that file."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"load_gpt2: cannot read {index}: {one_line(e)}") from e
    for file in [folder / n for n in names] if names is not None else [folder / "model.safetensors"]:
        try:
            with safe_open(file, "pt") as weights:
                weights.keys()
        except Exception as e:  # safetensors' Rust reader raises its own error type
            raise ValueError(f"load_gpt2: cannot read {file}: {one_line(e)}") from e


def load_gpt2(path: str | os.PathLike) -> GPT:
    """Our GPT from a GPT-2 directory written by ``save_pretrained`` (config.json and weights).

    Reads local files only; a missing directory is a FileNotFoundError, never a download.
    Only safetensors weights are read: a folder holding just a pickle (``pytorch_model.bin``)
    is a ValueError saying how to convert it, and so is a damaged weights file. The model loads
    whole or not at all: a ``config.json`` whose ``model_type`` is not ``gpt2``, and weights with
    a tensor missing or one GPT-2 does not have, are ValueErrors naming them (``transformers``
    alone would fill the gaps with random weights).
    """
    transformers = _transformers()
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_gpt2: {os.fspath(path)!r} is not a directory (expected one written by "
                                f"GPT2LMHeadModel.save_pretrained); models are never downloaded")
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        if pickles:
            raise ValueError(f"load_gpt2: {folder} holds its weights as a pickle ({pickles[0]}); only safetensors "
                             f"weights are loaded. Convert it once, where you trust the file: GPT2LMHeadModel."
                             f"from_pretrained('{folder}').save_pretrained('{folder}') writes model.safetensors")
        raise ValueError(f"load_gpt2: {folder} has no model.safetensors (expected a folder written by save_pretrained)")
    _check_weights(folder)
    config = folder / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type != "gpt2":
        raise ValueError(f"load_gpt2: {config} has model_type {model_type!r}, not 'gpt2'")
    logs = transformers.utils.logging
    shown, verbosity = logs.is_progress_bar_enabled(), logs.get_verbosity()
    logs.disable_progress_bar()  # a library prints nothing: no "Loading weights" bar, no load report
    logs.set_verbosity_error()  # (what the report says is raised below, as one line)
    try:
        hf_model, info = transformers.GPT2LMHeadModel.from_pretrained(
            folder, local_files_only=True, use_safetensors=True, output_loading_info=True)
    except Exception as e:  # safetensors' Rust reader, transformers' config and shape checks raise many types
        raise ValueError(f"load_gpt2: cannot read the model in {folder}: {one_line(e)}") from e
    finally:
        logs.set_verbosity(verbosity)
        if shown:
            logs.enable_progress_bar()
    wrong = [f"{kind} {listed(info[key])}" for kind, key in (("missing", "missing_keys"),
             ("unexpected", "unexpected_keys"), ("of another shape", "mismatched_keys")) if info[key]]
    if wrong:
        raise ValueError(f"load_gpt2: the weights in {folder} are not GPT-2's for its config.json: "
                         f"{'; '.join(wrong)}")
    return from_hf(hf_model)


def _names(n_layer: int) -> list[tuple[str, str, bool]]:
    """(our state_dict key, GPT-2's key, whether the weight is a transposed Conv1D) for every
    tensor; the tied LM head is not listed (it is the token embedding)."""
    pairs = [("wte.weight", "transformer.wte.weight", False), ("wpe.weight", "transformer.wpe.weight", False)]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        pairs += [(ours + a + p, theirs + b + p, transposed and p == "weight")
                  for a, b, transposed in (("ln_1.", "ln_1.", False), ("attn.qkv.", "attn.c_attn.", True),
                                           ("attn.proj.", "attn.c_proj.", True), ("ln_2.", "ln_2.", False),
                                           ("mlp.c_fc.", "mlp.c_fc.", True), ("mlp.c_proj.", "mlp.c_proj.", True))
                  for p in ("weight", "bias")]
    return pairs + [("ln_f.weight", "transformer.ln_f.weight", False), ("ln_f.bias", "transformer.ln_f.bias", False)]


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("selfattn.io.hf needs Hugging Face transformers: pip install 'selfattn[hf]'") from e
    return transformers
