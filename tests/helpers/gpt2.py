"""A tiny GPT-2 folder as ``save_pretrained`` writes it, with a BPE ``tokenizer.json``; offline."""
from pathlib import Path

import torch


def gpt2_folder(path: Path, *, n_layer: int = 2, n_head: int = 2, n_embd: int = 16, seed: int = 0) -> Path:
    """A random GPT-2 saved in ``path``; its vocabulary is a small BPE's plus <|endoftext|>."""
    import transformers

    from selfattn.tokenizers import BPETokenizer

    bpe = BPETokenizer.train("the cat sat on the mat. the dog sat on the log. " * 20, vocab_size=300)
    bpe.tok.add_special_tokens(["<|endoftext|>"])
    eot = bpe.tok.token_to_id("<|endoftext|>")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=bpe.tok.get_vocab_size(), n_positions=32, n_embd=n_embd,
                                     n_layer=n_layer, n_head=n_head, bos_token_id=eot, eos_token_id=eot)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    bpe.tok.save(str(path / "tokenizer.json"))
    return path
