"""File formats models come in, read without ``transformers``: each file here turns one format
into what :mod:`selfattn.families` maps (a ``config.json`` dict and tensors under ``transformers``'
names) and what :mod:`selfattn.tokenizers` reads.

- :mod:`~selfattn.io.formats.jsonfile`: a JSON object from a file, with errors naming the file;
- :mod:`~selfattn.io.formats.hf_folder`: a folder written by ``save_pretrained``: ``config.json``,
  ``model.safetensors`` or its shards (read tensor by tensor), its tokenizer files;
- :mod:`~selfattn.io.formats.gguf`: a GGUF file of llama.cpp: its metadata as a ``config.json`` dict,
  its tensors dequantised one at a time under ``transformers``' names;
- :mod:`~selfattn.io.formats.checkpoint`: ``selfattn train``'s own checkpoints, read and checked
  against their digest (written, atomically, by :mod:`selfattn.training.checkpoint`).
"""
