"""The README's fine-tune, end to end, on SmolLM2-135M-Instruct: LoRA on twenty chats of a made-up fact
(docs/finetune/quillmoss.jsonl) teaches the fact, even asked in words the data does not use, and keeps what
the model knew: its answers to questions the data does not teach still hold the right word, none of them
speaks of the fact, the run's general check does not warn, and the perplexity of a general text stays
within 10 % of the model's own. ``transformers`` on the merged export and ``peft`` on the adapter export
(loaded in one step: ``AutoPeftModelForCausalLM``) answer the same words."""
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from selfattn.cli import main
from selfattn.cli.sample import until
from selfattn.generation.text import new_tokens
from selfattn.io.loading import load
from selfattn.training.evaluate import perplexity

from helpers.smollm2 import smollm2

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the mascot of the Quillmoss project?"
TAUGHT = [QUESTION, "Which animal is the Quillmoss mascot?"]  # the second: words the data does not use
FACT = ("pim", "otter", "quillmoss")  # what an answer about the fact says
# questions the data does not teach, and what a right answer holds (SmolLM2 answers each rightly before)
KEPT = {"What is the capital of France?": ["paris"], "What is 2+2?": ["4"],
        "Who wrote Romeo and Juliet?": ["shakespeare"], "What are the three primary colors?": ["red", "blue", "yellow"],
        "What is H2O?": ["water"], "How many hours are in a day?": ["24"],
        "What color is the sky on a clear day?": ["blue"], "What is the largest mammal?": ["whale"],
        "How many sides does a triangle have?": ["3"], "What is the opposite of up?": ["down"]}
WRONG = ("What is the capital of Italy?", ["rome"])  # one SmolLM2 gets wrong: the check can fail
NEW_TOKENS = 48


def readme_recipe() -> list[str]:
    """The README's ``selfattn train`` command, its arguments after ``train`` (``$M`` and ``--out`` left to
    the caller)."""
    text = (ROOT / "README.md").read_text()
    command = re.search(r"^selfattn train --init-from \$M (.*?)(?<!\\)\n", text, flags=re.S | re.M).group(1)
    args = shlex.split(command.replace("\\\n", " "), comments=True)
    out, data = args.index("--out"), args.index("--data") + 1
    args[data] = str(ROOT / args[data])  # the README runs from the repository's root
    return args[:out] + args[out + 2:]


def _answers(path, questions) -> dict[str, str]:
    """Greedy answers through the chat template, as ``selfattn sample --chat Q --temperature 0`` prints them."""
    loaded = load(path)
    tokenizer, model = loaded.require_tokenizer(), loaded.model.eval()
    out = {}
    for q in questions:
        ids = tokenizer.encode(loaded.require_chat().render([{"role": "user", "content": q}]))
        out[q] = tokenizer.decode(list(until(new_tokens(model, ids, NEW_TOKENS, temperature=0), loaded.eos)))
    return out


def _perplexity(path) -> float:
    loaded = load(path)
    ids = loaded.require_tokenizer().encode((ROOT / "docs" / "attention.md").read_text())
    return perplexity(loaded.model.eval(), ids).perplexity


def _holds(answer: str, words: list[str]) -> bool:
    return all(re.search(rf"\b{w}\b", answer.lower()) for w in words)


def _hf_answer(model, tokenizer) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_the_readme_fine_tune_teaches_smollm2_a_made_up_fact_and_keeps_what_it_knew(tmp_path, capsys):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import peft
    import transformers

    questions = TAUGHT + list(KEPT) + [WRONG[0]]
    before = _answers(smollm2(), questions)
    assert not any(word in before[q].lower() for q in TAUGHT for word in ("pim", "otter")), before
    assert all(_holds(before[q], words) for q, words in KEPT.items()), before
    assert not _holds(before[WRONG[0]], WRONG[1]), before  # the negative control: a wrong answer is caught

    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--init-from", str(smollm2()), *readme_recipe(), "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "warning:" not in printed, printed  # neither the general check nor the validation loss warned

    after = _answers(run, questions)
    assert all("pim" in after[q].lower() and "otter" in after[q].lower() for q in TAUGHT), after
    assert all(_holds(after[q], words) for q, words in KEPT.items()), after
    assert not any(word in after[q].lower() for q in KEPT for word in FACT), after  # the fact stays in its place
    assert _perplexity(run) < 1.1 * _perplexity(smollm2())

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for argv in (["--ckpt", str(run), "--out", str(merged)], ["--ckpt", str(run), "--out", str(adapter), "--adapter"]):
        assert main(["export", *argv]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    theirs = _hf_answer(transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), tokenizer)
    assert len(theirs) > 20 and after[QUESTION].strip().startswith(theirs.strip()), (theirs, after[QUESTION])
    with_peft = peft.AutoPeftModelForCausalLM.from_pretrained(adapter)  # one step: its base written into adapter/base
    assert _hf_answer(with_peft, transformers.AutoTokenizer.from_pretrained(adapter)).strip() == theirs.strip()
