"""The Triton kernels build for an H100/H200 (sm_90) on this machine, without a GPU.

The interpreter (``triton_checks.py``) checks what the kernels compute; it runs them as NumPy
and forgives what only a GPU build sees (a variable typed differently in two branches, shapes
``tl.dot`` refuses, misused constexprs). Here Triton's front end, its GPU passes and ptxas
(shipped in the wheel) turn each kernel into a cubin, with every mask and score flag on and
with all of them off. A broken kernel fails the same build (the negative control).
"""
import pytest

from helpers.extras import needs_triton

pytestmark = needs_triton

FLAGS = ("CAUSAL", "HAS_WINDOW", "HAS_KPM", "HAS_DOC", "HAS_PREFIX", "HAS_ALIBI", "HAS_SOFTCAP", "HAS_SINKS")
TENSORS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")  # in the request's dtype
POINTER_TYPES = {"KPM": "*u8", "DOC": "*i64", "PREFIX": "*i64", "NUM": "*i32", "IDX": "*i32", "FULL_NUM": "*i32",
                 "FULL_IDX": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "SLOPES": "*fp32", "SINKS": "*fp32"}
FLOATS = ("scale", "qk_scale", "cap")


def build(kernel, dtype: str, constexprs: dict) -> bytes:
    """The cubin of ``kernel`` (a @triton.jit function, under an autotuner or not) for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):
        fn = fn.fn  # the autotuner's JITFunction
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    types = {**dict.fromkeys(TENSORS, f"*{dtype}"), **POINTER_TYPES, **dict.fromkeys(FLOATS, "fp32"),
             **dict.fromkeys(constexprs, "constexpr")}
    signature = {name: types.get(name, "i32") for name in fn.arg_names}  # sizes, strides, positions: i32
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}
                          ).asm["cubin"]


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # build, never reuse an earlier build


@pytest.mark.parametrize("flags", [True, False], ids=["every-flag", "no-flag"])
@pytest.mark.parametrize("kernel", ["fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel"])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_the_kernels_build_for_sm90(kernel, flags):
    from selfattn.backends import triton_kernels

    constexprs = dict(dict.fromkeys(FLAGS, flags), D=80, BLOCK_D=128, DOT_PRECISION="tf32", MAP_BLOCK=128,
                      BLOCK_M=64, BLOCK_N=64)
    cubin = build(getattr(triton_kernels, kernel), "bf16", constexprs)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000


def test_a_kernel_the_gpu_cannot_build_fails_here_too():
    import triton
    import triton.language as tl

    @triton.jit
    def broken(Q, O, N: tl.constexpr):
        a = tl.load(Q + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :])  # (N, N)
        b = tl.load(Q + tl.arange(0, N // 2)[:, None] * N + tl.arange(0, N)[None, :])  # (N/2, N)
        tl.store(O + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :], tl.dot(a, b))  # inner dims differ

    with pytest.raises(Exception, match="(?i)dot|shape"):
        build(broken, "fp16", {"N": 32})
