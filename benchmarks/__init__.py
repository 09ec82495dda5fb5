"""Benchmarks: our attention, decoding and training side by side with the peers, in one run.

Suites (``python -m benchmarks SUITE``), each a module with ``Settings``, ``FULL`` and ``QUICK``
settings, ``run(settings, device, log=...) -> result``, ``report(result) -> text`` and
``plot(result, path)``:

- ``attention`` (:mod:`~benchmarks.attention`): our backends and the peers (the seed's
  module, ``nn.MultiheadAttention``, nanoGPT's attention, transformers' GPT-2 attention),
  forward and forward+backward, as T sweeps at fixed B·T: median time, ratio to the fastest,
  GFLOP/s against this machine's measured matmul, peak memory (:mod:`~benchmarks.memory`);
- ``decode`` (:mod:`~benchmarks.decode`): tokens/s of greedy generation, our KV cache vs
  no cache vs transformers' ``generate`` on the same GPT-2-shaped weights;
- ``speculative`` (:mod:`~benchmarks.speculative`): speculative decoding on a real model (prompt
  lookup, self-speculation) against plain decoding and ``transformers``' ``generate`` with and
  without prompt lookup, on a chat answer and an edit that repeats its prompt;
- ``int8`` (:mod:`~benchmarks.quantized`): weight-only int8 against the float model on a real
  model: perplexity and top-1 agreement on the built-in corpus, batch-1 decode time per token;
- ``train`` (:mod:`~benchmarks.train`): tokens/s of a training step, our GPT vs a
  nanoGPT-equivalent model;
- ``finetune`` (:mod:`~benchmarks.finetune`): a fine-tuning step on SmolLM2, full and LoRA, float32
  and bfloat16 autocast, against ``transformers`` (+ ``peft``) on the same weights: tokens/s, peak memory;
- ``surgery`` (:mod:`~benchmarks.surgery`): SmolLM2 given a sliding window with sink tokens: its
  perplexity before, right after and after a fine-tune, its decode speed and KV cache at a long context;
- ``interp`` (:mod:`~benchmarks.interp`): :mod:`selfattn.interp` against TransformerLens on SmolLM2: a plain
  forward, ``run_with_cache`` of every site and of three, a head sweep of activation patching: median time, peak memory;
- ``serving`` (:mod:`~benchmarks.serving`): ``selfattn serve`` against llama.cpp's ``llama-server`` on
  SmolLM2's GGUF file, 1, 4 and 16 concurrent streaming chat clients: aggregate tokens/s, time to first
  token and inter-token latency (median, p95);
- ``loading`` (:mod:`~benchmarks.loading`): SmolLM2's and Gemma 3's GGUF files loaded and ready to generate,
  ours against llama.cpp's start to first token, each in fresh processes;
- ``decode-llama`` (:mod:`~benchmarks.decode_llama`): batch-1 decode and prefill tokens/s on SmolLM2 and Gemma 3 in
  float32, bfloat16 and int8, against ``llama-bench`` on the files requantised to F32, BF16 and Q8_0, interleaved;
- ``masks`` (:mod:`~benchmarks.masks`): windows, packed documents, padding and plain causal
  at T = 4096 and 16384, every backend and ``auto``'s choice against SDPA with a dense mask and
  compiled FlexAttention;
- ``context-parallel`` (:mod:`~benchmarks.context_parallel`): ring attention over N local
  processes against one: memory per rank, bytes sent against the formula, the layouts' balance;
- ``triton`` (:mod:`~benchmarks.triton_gpu`, CUDA only): the Triton kernel's parity at
  real sizes and its TFLOP/s against SDPA's FlashAttention and cuDNN backends;

Every implementation is checked against the reference before it is timed
(:class:`~benchmarks.common.CorrectnessError` otherwise). The implementations and peers
live in :mod:`~benchmarks.impls` and :mod:`~benchmarks.peers`.
"""
from benchmarks import (
          attention,
          context_parallel,
          decode,
          decode_llama,
          finetune,
          interp,
          loading,
          masks,
          quantized,
          serving,
          speculative,
          surgery,
          train,
          triton_gpu,
)

SUITES = {"attention": attention, "decode": decode, "speculative": speculative, "int8": quantized, "train": train,
          "finetune": finetune, "surgery": surgery, "interp": interp, "serving": serving,
          "loading": loading, "decode-llama": decode_llama, "masks": masks,
          "context-parallel": context_parallel, "triton": triton_gpu}
GPU_ONLY = ("triton",)  # left out of ``all`` where there is no CUDA device
