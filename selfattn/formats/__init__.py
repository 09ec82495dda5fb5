"""File formats models come in and go out in, read without ``transformers``: each file here turns one
format into what :mod:`selfattn.families` maps (a ``config.json`` dict and tensors under ``transformers``'
names) and what :mod:`selfattn.tokenizers` reads, and back.

The formats sit below the loader (:mod:`selfattn.io`) and LoRA (:mod:`selfattn.lora`), which both use them,
and above the families and the tokenizers, which they fill: plain data in and out, no model loaded here.

- :mod:`~selfattn.formats.hf_folder`: a folder written by ``save_pretrained``: ``config.json``,
  ``model.safetensors`` or its shards (read tensor by tensor), its tokenizer files;
- :mod:`~selfattn.formats.gguf`: a GGUF file of llama.cpp: its metadata as a ``config.json`` dict,
  its tensors dequantised one at a time under ``transformers``' names;
- :mod:`~selfattn.formats.checkpoint`: ``selfattn train``'s own checkpoints, read and checked
  against their digest (written, atomically, by :mod:`selfattn.training.checkpoint`);
- :mod:`~selfattn.formats.gguf_write`: a GGUF file written (by :mod:`selfattn.io.gguf_export`);
- :mod:`~selfattn.formats.peft`: ``peft``'s LoRA adapter folders, written and read (by :mod:`selfattn.lora`).
"""
