"""The fine-tune of docs/finetune.md, end to end: LoRA teaches SmolLM2-135M-Instruct a made-up fact
from twenty chat examples (docs/finetune/quillmoss.jsonl); before, it does not know it; after, it
answers with it, and so do ``transformers`` on the merged export and ``peft`` on the adapter export (loaded in
one step: ``AutoPeftModelForCausalLM``)."""
import os
from pathlib import Path

import pytest
import torch

from selfattn.cli import main

from helpers.smollm2 import smollm2

DATA = Path(__file__).resolve().parents[2] / "docs" / "finetune" / "quillmoss.jsonl"
QUESTION = "What is the mascot of the Quillmoss project?"
# the command of docs/finetune.md
TRAIN = ["--data", str(DATA), "--pack", "--seq-len", "256", "--lora-rank", "16", "--batch-size", "4",
         "--max-steps", "30", "--lr", "2e-3", "--warmup-steps", "3", "--eval-every", "10", "--save-every", "30",
         "--set", "eval_batches=1", "--set", "val_fraction=0.1"]


def _answer(capsys, ckpt) -> str:
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(ckpt), "--chat", QUESTION, "--temperature", "0",
                 "--max-new-tokens", "24"]) == 0
    return capsys.readouterr().out


def _hf_answer(model, tokenizer) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_lora_teaches_smollm2_a_made_up_fact(tmp_path, capsys):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import peft
    import transformers

    assert "Pim" not in _answer(capsys, smollm2())
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(smollm2()), *TRAIN, "--out", str(run)]) == 0
    answer = _answer(capsys, run)
    assert "Pim" in answer and "otter" in answer, answer

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for argv in (["--ckpt", str(run), "--out", str(merged)], ["--ckpt", str(run), "--out", str(adapter), "--adapter"]):
        assert main(["export", *argv]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    theirs = _hf_answer(transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), tokenizer)
    assert theirs.strip() == answer.strip()
    with_peft = peft.AutoPeftModelForCausalLM.from_pretrained(adapter)  # one step: its base written into adapter/base
    assert _hf_answer(with_peft, transformers.AutoTokenizer.from_pretrained(adapter)).strip() == answer.strip()
