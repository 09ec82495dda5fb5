"""Models in and out: :mod:`~selfattn.io.loading` (one loader for every path a command takes: run folders,
checkpoints, ``transformers`` folders, GGUF files), :mod:`~selfattn.io.export` (a run as a folder
``transformers`` loads), :mod:`~selfattn.io.hf` (GPT-2 to and from ``transformers``),
:mod:`~selfattn.io.gguf_export` (a GGUF file llama.cpp runs). The file formats themselves are a floor below,
:mod:`selfattn.formats`."""
