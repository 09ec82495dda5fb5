"""Our decoder and its tokenizer as a GGUF file that llama.cpp runs, written with the ``gguf`` package
(llama.cpp's own writer): the inverse of :mod:`selfattn.formats.gguf` and :mod:`selfattn.tokenizers.gguf`.

The architecture is that of the first family of :data:`selfattn.families.writing.WRITTEN` (Llama, Qwen2, Qwen3,
Gemma 2, Gemma 3, OLMo 2, Phi-3, BLOOM, GPT-2, gpt-oss) that declares llama.cpp's names (its ``GGUF``,
:mod:`selfattn.families._gguf`) and whose ``config.json`` says all of the model, or else of the model with a
zero bias wherever it has none (the same function: a GPT-2-shaped run of ``selfattn train``, written with
the biases llama.cpp's gpt2 needs), and computes what llama.cpp's architecture computes whatever its file says
(the family's ``fixed``: GPT-2's GELU is the tanh approximation, Phi-3 has no window, gpt-oss's experts clamp
at 7); :func:`architecture` says which. By that declaration, inverted:

- metadata: each declared field ``<arch>.<field>`` from the ``config.json`` key it is read into (the RoPE
  base from ``rope_parameters``, the global layers' where each kind of layer has its own), ``vocab_size``,
  ``attention.value_length`` beside ``key_length``; and what llama.cpp reads under its own generic keys, so
  that no rule has to derive it: the rotated channels of a head (``rope.dimension_count``), the window
  (``attention.sliding_window``), which layers slide (``attention.sliding_window_pattern``, a bool a layer),
  the sliding layers' RoPE base (``rope.freq_base_swa``), the soft-caps (``attn_logit_softcapping``,
  ``final_logit_softcapping``), a linear or YaRN RoPE scaling (``rope.scaling.*``; Llama 3's rule is the
  tensor ``rope_freqs``; LongRoPE is refused: llama.cpp picks its long or short factors by another rule, and
  so is a YaRN whose ramp llama.cpp would turn otherwise: ``truncate`` false, betas other than 32 and 1);
- tensors under llama.cpp's names (a tied head written once, as ``token_embd``; a tensor the architecture has
  no place for in ``gguf``'s table of llama.cpp's tensors is refused: Gemma 2's untied head), the norm offset
  added to every norm weight (Gemma's ``1 + w``), the q/k rows (and biases) of an ``interleaved``
  architecture permuted as llama.cpp's converter permutes them for its RoPE (Llama's), the rows (and bias)
  of a ``by_head`` fused q, k, v regrouped from the folder's per head to q, k, v apart (BLOOM's), an
  ``alternated`` tensor split into its even and odd entries along the last dimension and the ``transposed``
  ones transposed (gpt-oss's experts: ``(E, C, 2I)`` -> ``ffn_gate_exps`` and ``ffn_up_exps``, each
  ``(E, I, C)``, and ``down_proj`` ``(E, I, C)`` -> ``ffn_down_exps`` ``(E, C, I)``);
- each matrix in the type asked for (:data:`TYPES`: F32, F16, BF16 or Q8_0, quantised by ``gguf.quants``, row
  by row, each expert's too; a Q8_0 matrix whose rows are no whole blocks of 32 is F16, as the converter does),
  as the converter keeps them every 1-D tensor (norms, biases, sinks), every bias (the experts' 2-D ones) and a
  mixture's router (``ffn_gate_inp``) in F32;
- the tokenizer's ``tokenizer.*`` fields, a GGUF source's copied (:func:`selfattn.tokenizers.gguf.to_metadata`:
  the inverse of its reader, beside it).

A model no declared family says, one llama.cpp computes otherwise (naming each field and both values), or a
tokenizer llama.cpp would split otherwise, is one ValueError naming what is missing. What the fields cannot
carry beyond that is not checked here: read the file back and compare (:mod:`selfattn.io.gguf_export` does).
Not written: a window on a Llama, Mistral or Qwen (llama.cpp's llama, qwen2 and qwen3 read none), gpt-oss
without a sliding layer (llama.cpp's gpt-oss asserts one: its ``attention.sliding_window`` is required).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from selfattn._util import progress
from selfattn.families import FAMILIES, GGUF_ARCHITECTURES, writing
from selfattn.families._gguf import REQUIRED
from selfattn.model import GPT
from selfattn.rope import rope_frequencies
from selfattn.tokenizers.gguf import to_metadata

TYPES = ("f32", "f16", "bf16", "q8_0")  # the tensor types a file is written in


@dataclass
class Written:
    """What :func:`write` wrote."""
    architecture: str  # general.architecture, llama.cpp's name
    model_type: str  # the transformers family it is (its config.json's model_type)
    types: dict[str, int]  # tensor type -> how many tensors are of it ("F32": 5, "Q8_0": 9)
    tokenizer: str  # tokenizer.ggml.model, and its pre-tokenizer where it has one: "gpt2 (pre gpt-2)"
    zero_biases: bool = False  # the model lacks biases llama.cpp's architecture needs: written as zeros


def architecture(config) -> tuple[str, str, dict, bool]:
    """(llama.cpp's architecture, the family's model_type, its ``config.json`` dict, whether biases the model
    lacks are written as zeros) that says all of ``config`` (a :class:`~selfattn.model.GPTConfig`): the first
    family of :data:`selfattn.families.writing.WRITTEN` with llama.cpp's names whose ``config.json`` says the
    model, or else the model with zero biases, and whose ``fixed`` values it computes. A ValueError naming what
    llama.cpp computes instead when only such a family says it, else naming the families tried."""
    declared = {model_type: arch for arch, model_type in GGUF_ARCHITECTURES.items()}
    archs = tuple(a for a in writing.WRITTEN if a in declared)
    clashes = []
    biased = writing.with_biases(config)
    for c in [config] + ([biased] if biased != config else []):
        for model_type in archs:
            hf = writing.says(c, model_type)
            clash = None if hf is None else _clash(declared[model_type], model_type, hf, c)
            if hf is not None and clash is None:
                return declared[model_type], model_type, hf, c is biased
            clashes += [clash] if clash else []
    if clashes:
        raise ValueError(clashes[0])
    raise ValueError(f"llama.cpp runs none of the families that could say this model: no family of "
                     f"{', '.join(archs)} (those with llama.cpp's names) computes it, so no GGUF file says it")


def _clash(arch: str, model_type: str, hf: dict, config) -> str | None:
    """Why llama.cpp's ``arch`` computes another model than ``config`` (which ``model_type``'s ``config.json``
    ``hf`` says) whatever its file says (the family's ``fixed`` values): each field and both values; None when
    it computes the same."""
    family = FAMILIES[model_type]
    if not family.GGUF.fixed:
        return None
    ours, theirs = (writing.computes(c) for c in (config, family.config({**hf, **family.GGUF.fixed}, model_type)))
    differ = [f"{name}={ours[name]!r} (llama.cpp's: {theirs[name]!r})" for name in ours if ours[name] != theirs[name]]
    if not differ:
        return None
    fixed = ", ".join(f"{key} {value!r}" for key, value in family.GGUF.fixed.items())
    return (f"llama.cpp's {arch} computes {model_type}'s {fixed} whatever a file says, so no GGUF file says this "
            f"model: " + "; ".join(differ))


def write(gpt: GPT, tokenizer, path: str | os.PathLike, *, type: str = "f32", bos: int | None = None,
          eos: tuple[int, ...] = (), chat_template: str | None = None,
          source: str | os.PathLike | None = None, pre: str | None = None) -> Written:
    """Write ``gpt`` and ``tokenizer`` to the GGUF file ``path`` (see the module docstring), its matrices in
    ``type`` (one of :data:`TYPES`), ``bos``, ``eos`` and ``chat_template`` its special tokens and template;
    ``source``: where the model came from, whose ``tokenizer.*`` fields are copied when it is a GGUF file;
    ``pre``: the ``tokenizer.ggml.pre`` of the GGUF file the tokenizer came from (a fine-tuned run's source)."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("writing a GGUF file needs the 'gguf' package: pip install 'selfattn[gguf]'") from e
    from selfattn.formats.gguf import is_gguf, read  # the reader, only for a GGUF source

    if type not in TYPES:
        raise ValueError(f"unknown GGUF tensor type {type!r}; choose one of {', '.join(TYPES)}")
    if not isinstance(gpt, GPT):
        raise TypeError(f"write expects a selfattn GPT, got {gpt.__class__.__name__}")
    arch, model_type, hf, zero_biases = architecture(gpt.config)
    gpt = writing.with_zero_biases(gpt) if zero_biases else gpt  # llama.cpp's architecture needs them
    names = FAMILIES[model_type].GGUF
    vocab = gpt.config.vocab_size
    fields = to_metadata(tokenizer, vocab, bos=bos, eos=eos, chat_template=chat_template,
                         source=read(source).metadata if source is not None and is_gguf(source) else None, pre=pre)
    qtype = gguf.GGMLQuantizationType[type.upper()]
    w = _writer(str(path), arch)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in _metadata(arch, names, hf, gpt.config).items():
        w.add_key_value(key, value, _value_type(value), _value_type(value[0]) if isinstance(value, list) else None)
    for key, value in fields.items():
        w.add_key_value(key, value, *_tokenizer_type(value))
    types = {}
    with progress.stage("converting the tensors"):
        tensors = _tensors(arch, names, model_type, gpt)
    for name, a in progress.track(tensors.items(), f"{type} tensors", total=len(tensors), unit="tensor"):
        kind = gguf.GGMLQuantizationType.F32 if _kept_f32(name, a) else qtype
        if kind == gguf.GGMLQuantizationType.Q8_0 and a.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            kind = gguf.GGMLQuantizationType.F16  # rows of no whole blocks: F16, as llama.cpp's converter does
        w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
        types[kind.name] = types.get(kind.name, 0) + 1
    with progress.stage("writing the GGUF file"):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    pre = fields.get(gguf.Keys.Tokenizer.PRE)
    return Written(arch, model_type, types, fields[gguf.Keys.Tokenizer.MODEL] + (f" (pre {pre})" if pre else ""),
                   zero_biases)


def _metadata(arch: str, names, hf: dict, config) -> dict:
    """The model's metadata fields, ``<arch>.<field>`` -> value (see the module docstring)."""
    rope = hf.get("rope_parameters") or {}
    flat = {**rope.get("full_attention", rope), **hf}  # the RoPE base beside the sizes, as the declaration reads it
    out = {}
    for key, (field, kind, default) in names.fields.items():
        if flat.get(key) is None:
            if default is REQUIRED:
                raise ValueError(f"llama.cpp's {arch} needs {arch}.{field}, and the model's config.json has no {key}")
            continue
        out[f"{arch}.{field}"] = kind(flat[key])
    if f"{arch}.attention.key_length" in out:
        out[f"{arch}.attention.value_length"] = out[f"{arch}.attention.key_length"]
    out[f"{arch}.vocab_size"] = config.vocab_size
    c = config
    slides = [c.layer_window(i) is not None for i in range(c.n_layer)]
    generic = {"rope.dimension_count": c.rope_dims, "attention.sliding_window": c.window,
               "rope.freq_base_swa": c.window_rope_base,
               "attn_logit_softcapping": c.softcap, "final_logit_softcapping": c.logit_softcap,
               "attention.sliding_window_pattern": slides if c.window else None,
               **_rope_scaling(c.rope_scaling or {})}
    return out | {f"{arch}.{field}": value for field, value in generic.items() if value is not None}


def _rope_scaling(s: dict) -> dict:
    """llama.cpp's fields of a RoPE scaling rule: linear, or YaRN (its attention factor as a multiple of
    llama.cpp's own, 0.1 ln(factor) + 1). Llama 3's writes none here (it is a tensor); LongRoPE's is a
    ValueError: llama.cpp computes it otherwise."""
    kind, factor = s.get("rope_type"), s.get("factor")
    if kind == "longrope":
        raise ValueError("rope_scaling of rope_type 'longrope' is not written to GGUF: llama.cpp takes the long "
                         "factors when its context is longer than original_max_position_embeddings, this library "
                         "(as transformers) when the sequence is, so the file would compute another model")
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(factor)}
    if kind != "yarn":
        return {}
    fixed = {"truncate": True, "beta_fast": 32.0, "beta_slow": 1.0}  # llama.cpp's YaRN, whatever a file says
    differ = [f"{key}={s[key]!r} (llama.cpp's: {value!r})" for key, value in fixed.items()
              if s.get(key, value) != value]
    if differ:
        raise ValueError("rope_scaling of rope_type 'yarn' with " + ", ".join(differ) + " is not written to GGUF: "
                         "llama.cpp's YaRN rounds the ramp's ends outward, between 32 and 1, whatever a file says")
    attention = s.get("attention_factor")
    return {"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor),
            "rope.scaling.original_context_length": s["original_max_position_embeddings"],
            "rope.scaling.attn_factor": None if attention is None else attention / (0.1 * math.log(factor) + 1)}


def _tensors(arch: str, names, model_type: str, gpt: GPT) -> dict:
    """llama.cpp's name -> the tensor as a float32 numpy array, as the file holds it (offset, rows permuted, an
    ``alternated`` tensor split in two halves, ``transposed`` ones transposed), and Llama 3's RoPE rule as
    ``rope_freqs`` (each frequency's divisor, as the converter writes it); a ValueError for a tensor llama.cpp's
    architecture has no place for (by ``gguf``'s table of its tensors)."""
    import gguf
    import numpy as np

    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[{v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]]}
    config = gpt.config
    heads = {"attn_q": config.n_head, "attn_k": config.n_kv_head or config.n_head}
    out = {}
    for hf_name, tensor in writing.folder_tensors(model_type, gpt).items():
        named = _gguf_names(names, hf_name)
        if not named or any(re.sub(r"^blk\.\d+\.", "blk.{bid}.", n.rpartition(".")[0]) not in known for n in named):
            raise ValueError(f"llama.cpp's {arch} has no tensor for the model's {hf_name}"
                             + (f" ({' + '.join(named)})" if named else "") + ", so no GGUF file of it says this model")
        a = tensor.detach().to("cpu", copy=True).float().numpy()
        for name, a in zip(named, [a] if len(named) == 1 else _unalternated(a)):
            module = name.split(".")[-2]
            if arch in names.interleaved and module in heads:
                a = _interleave(a, heads[module])
            if module in names.by_head:
                a = _regroup(a, config.n_head)
            if names.norm_offset and name.endswith("norm.weight"):
                a += np.float32(names.norm_offset)
            if name.split(".", 2)[-1] in names.transposed:
                a = np.ascontiguousarray(a.swapaxes(-1, -2))  # (E, in, out) -> (E, out, in): llama.cpp's rows
            out[name] = a
    if (config.rope_scaling or {}).get("rope_type") == "llama3":  # Llama 3's rule: a divisor per frequency
        if "rope_freqs" not in known:
            raise ValueError(f"llama.cpp's {arch} has no rope_freqs tensor for the model's Llama 3 RoPE rule")
        rotated = config.rope_dims or config.head_dim or config.n_embd // config.n_head
        out["rope_freqs.weight"] = (rope_frequencies(rotated, config.rope_base)[0] /
                                    rope_frequencies(rotated, config.rope_base, config.rope_scaling)[0]).float().numpy()
    return out


def _gguf_names(names, hf_name: str) -> list[str]:
    """llama.cpp's names of the folder's tensor ``hf_name`` by the family's ``names`` (the inverse of
    ``Names.hf_name``): one, or the two halves of an ``alternated`` tensor (its even entries first); none when
    the family declares no name for it."""
    outside = {hf: ours for ours, hf in names.outside.items()}
    if hf_name in outside:
        return [outside[hf_name]]
    layer = re.escape(names.layer).replace(re.escape("{i}"), r"(\d+)")
    match = re.fullmatch(layer + r"(.+)", hf_name)
    if match is None:
        return []
    block, rest = f"blk.{match[1]}.", match[2]
    if rest in names.alternated:
        return [block + half for half in names.alternated[rest]]
    whole = {hf: ours for ours, hf in names.in_block.items() if "." in ours}  # "attn_sinks.weight": a tensor
    modules = {hf: ours for ours, hf in names.in_block.items() if "." not in ours}  # "attn_q": its weight, bias
    module, _, param = rest.rpartition(".")
    if rest in whole:
        return [block + whole[rest]]
    return [f"{block}{modules[module]}.{param}"] if module in modules else []


def _unalternated(a) -> list:
    """The two halves llama.cpp's converter splits an ``alternated`` tensor into: its even entries along the last
    dimension, then its odd ones (gpt-oss's gate and up, ``(..., 2I)`` -> two ``(..., I)``)."""
    import numpy as np

    return [np.ascontiguousarray(a[..., half::2]) for half in (0, 1)]


def _kept_f32(name: str, a) -> bool:
    """Whether llama.cpp's tensor ``name`` (the array ``a``) stays F32 whatever the type asked, as its converter
    keeps it: a 1-D one (norms, biases, sinks), a bias (the experts' 2-D ones too), the router (``ffn_gate_inp``)."""
    return a.ndim == 1 or not name.endswith(".weight") or ".ffn_gate_inp." in name


def _interleave(a, heads: int):
    """llama.cpp's converter's permutation of q or k rows (its ``LlamaModel.permute``): per head, the rows
    of the two RoPE halves interleaved."""
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _regroup(a, heads: int):
    """llama.cpp's converter's regrouping of a fused q, k, v tensor's rows (or bias) from per head
    (``(H, 3, D)``: BLOOM's in ``transformers``) to q, k, v apart (``(3, H, D)``)."""
    return a.reshape(heads, 3, a.shape[0] // heads // 3, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def _value_type(value):
    import gguf

    V = gguf.GGUFValueType
    kinds = {bool: V.BOOL, int: V.UINT32, float: V.FLOAT32, str: V.STRING, list: V.ARRAY}
    if type(value) not in kinds:
        raise TypeError(f"no GGUF type for the metadata value {value!r}")
    return kinds[type(value)]


def _tokenizer_type(value) -> tuple:
    """(GGUF type, the type of an array's entries) of a tokenizer field's value, as llama.cpp's converter
    writes them: ids and counts UINT32, token types INT32, scores FLOAT32; an empty array (a byte
    vocabulary's merges) of strings."""
    import gguf

    V = gguf.GGUFValueType
    if not isinstance(value, list):
        return _value_type(value), None
    entry = V.STRING if not value else V.INT32 if _value_type(value[0]) == V.UINT32 else _value_type(value[0])
    return V.ARRAY, entry


def _writer(path: str, arch: str):
    """``gguf.GGUFWriter`` of ``path``, except that it writes an empty array as GGUF says one (its type, length
    0), which llama.cpp reads: a byte vocabulary has no merges, and llama.cpp's BPE needs the field."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0:  # gguf's own refuses one
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(path, arch)
