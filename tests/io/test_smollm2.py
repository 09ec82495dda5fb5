"""A real model, offline: SmolLM2-135M-Instruct as a Q4_1 GGUF file loads with its tokenizer and
chat template, and computes, tokenizes and renders what transformers does from the same file; the
commands run on it, and asked for the capital of France it answers Paris."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.cli import run as bench  # noqa: E402
from selfattn.cli import main  # noqa: E402
from selfattn.formats import gguf as formats_gguf  # noqa: E402
from selfattn.generation import generate  # noqa: E402
from selfattn.generation.text import text_pieces  # noqa: E402
from selfattn.io import loading  # noqa: E402
from selfattn.tokenizers.gguf import from_metadata  # noqa: E402

from helpers.smollm2 import smollm2  # noqa: E402

transformers.logging.set_verbosity_error()
TEXTS = ["Hello world", "  two  spaces, a\ttab\n\nand blank lines\n", "digits 2024, 3.14159 and 1234567890",
         "emoji 🎉🚀👩‍💻 and ünïcödé, 中文, русский", "def f(x):\n    return x ** 2  # code\n\tif x != 0: pass",
         "<|im_start|>user\nhi<|im_end|>\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3? 🎲"}],
]


@pytest.fixture(scope="module")
def ours():
    return loading.load(smollm2())


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = smollm2()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_tokenizer_gives_transformers_ids_and_streams_back_byte_exactly(ours, hf_tokenizer):
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert "".join(text_pieces(ours.tokenizer, ids)) == text  # one token at a time, characters split or not
    assert len(ours.tokenizer.encode(TEXTS[5])) == 6  # <|im_start|>, <|im_end|> are one token each


def test_without_all_merges_the_ids_differ(ours, monkeypatch):  # negative control of the comparison
    value = formats_gguf.Metadata.value
    monkeypatch.setattr(formats_gguf.Metadata, "value", lambda self, key, *a: value(self, key, *a)[2000:]
                        if key == "tokenizer.ggml.merges" else value(self, key, *a))
    fewer = from_metadata(formats_gguf.read(smollm2()).metadata)
    assert any(fewer.encode(text) != ours.tokenizer.encode(text) for text in TEXTS)


def test_the_chat_template_renders_as_transformers_renders_it(ours, hf_tokenizer):
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.chat.render(messages, add_generation_prompt=prompt) == expected
    asked = ours.chat.render(CONVERSATIONS[0])
    assert asked.endswith("<|im_start|>assistant\n") and asked != ours.chat.render(CONVERSATIONS[0],
                                                                                   add_generation_prompt=False)


def test_the_config_and_special_tokens_come_from_the_metadata(ours):
    c = ours.model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.intermediate_size, c.vocab_size) == (30, 9, 3, 576, 1536,
                                                                                               49152)
    assert c.tie_embeddings and c.rope_base == 100000.0 and ours.model.lm_head.weight is ours.model.wte.weight
    assert ours.start_token == 1 and ours.eos == (2,)
    assert [ours.tokenizer.tok.id_to_token(i) for i in (1, 2)] == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.slow
def test_logits_and_greedy_tokens_equal_transformers_reading_the_same_file(ours):
    path = smollm2()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    model = ours.model.eval()
    idx = torch.tensor([ours.tokenizer.encode(ours.chat.render(CONVERSATIONS[1]))])  # (1, T)
    with torch.no_grad():
        expected, got = hf(idx).logits, model(idx)[0]
    diff = (got - expected).abs().max().item()
    print(f"SmolLM2 Q4_1: max |logit difference| {diff:.1e} over {idx.shape[1]} positions "
          f"(largest logit {expected.abs().max():.1f})")
    assert diff < 1e-3 and expected.abs().max() > 10
    hf.generation_config.eos_token_id = None  # 48 tokens on both sides: eos neither stops nor is suppressed
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=48, do_sample=False,
                         pad_token_id=2)[0, idx.shape[1]:]
    assert len(theirs) == 48 and 2 in theirs.tolist()  # the answer ends (eos) and goes on past it
    mine = torch.stack(list(generate(model, idx, 48, temperature=0)), 1)[0]
    assert torch.equal(mine, theirs), (ours.tokenizer.decode(mine), ours.tokenizer.decode(theirs))


def test_sample_chat_answers_paris_and_stops_at_eos(capsys):
    assert main(["sample", "--ckpt", str(smollm2()), "--chat", "What is the capital of France?",
                 "--temperature", "0", "--max-new-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "<|im_end|>" not in out and out.endswith(".\n") and len(out) < 120, out
    assert main(["sample", "--ckpt", str(smollm2()), "--prompt", "The capital of France is", "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and len(out) > len("The capital of France is") + 5


@pytest.mark.slow
def test_an_export_carries_the_files_special_tokens_and_chat_template(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(smollm2()), "--out", str(out)]) == 0
    config, tokenizer = (json.loads((out / name).read_text()) for name in ("config.json", "tokenizer_config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # the GGUF's, not <|endoftext|> = 0
    assert (tokenizer["bos_token"], tokenizer["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        loading.load(smollm2()).chat.render(chat, add_generation_prompt=True)  # the file's template
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(out), "--chat", "What is the capital of France?", "--temperature", "0",
                 "--max-new-tokens", "40"]) == 0
    answer = capsys.readouterr().out
    assert "Paris" in answer and "<|im_end|>" not in answer and len(answer) < 120, answer  # it stops at the end


@pytest.mark.slow
@pytest.mark.parametrize("command", [["check", "--method", "perturb", "--seq-len", "8"],  # the 30 layers are slow:
                                     ["heads", "--text", "the cat sat, the cat sat", "--layers", "0,29"],  # a few
                                     ["explore", "--text", "the cat sat, the cat sat"]])
def test_explore_heads_and_check_run_on_it(command, tmp_path, capsys):
    out = ["--out", str(tmp_path / ("page.html" if command[0] == "explore" else "heads"))] \
        if command[0] != "check" else []
    assert main([command[0], "--ckpt", str(smollm2()), *command[1:], *out]) == 0
    printed = capsys.readouterr().out
    assert {"check": "2 of 2 cases ok", "heads": "induction", "explore": "30 layers x 9 heads"}[command[0]] in printed


@pytest.mark.slow
def test_bench_decode_times_it_against_transformers(tmp_path, capsys):
    import json

    assert bench(["decode", "--quick", "--threads", "1", "--ckpt", str(smollm2()), "--prompts", "8",
                 "--batches", "1", "--dtypes", "float32", "--new-tokens", "4", "--ckpt-prompt", "8",
                 "--ckpt-new-tokens", "4", "--reps", "1", "--no-memory", "--bandwidth-mib", "16",
                 "--out", str(tmp_path)]) == 0  # one thread: beside another test worker, 140 s -> about 20 s
    result = json.loads((tmp_path / "decode.json").read_text())
    assert result["ckpt"]["name"] == "SmolLM2-135M-Instruct.Q4_1" and result["ckpt"]["params"] > 134e6
    assert "SmolLM2-135M-Instruct.Q4_1 float32: cached vs full" in capsys.readouterr().out


PARAGRAPH = (
    "The lighthouse stood at the end of a narrow spit of rock, and for more than a hundred years its keepers had "
    "climbed the same spiral stairs every evening to light the lamp. In the early days the light came from whale "
    "oil, which smoked and had to be trimmed through the night; later it was kerosene, and at last electricity, "
    "which needed no one at all. The final keeper left in the spring of the year the light was automated. He "
    "packed his books, his charts and a small brass telescope, and walked back along the causeway at low tide "
    "without looking behind him. People in the village said that he had been glad to go, but the children who "
    "visited him in the years that followed remembered that he always asked whether the light was still turning. "
    "Ships no longer needed it much by then. Satellites told every captain where he was to within a few metres, "
    "and the great lens, ground by hand in a workshop in Paris, turned for nobody in particular. Still, on stormy "
    "nights the fishermen looked for it as they came round the headland, and when they saw the long white beam "
    "sweep across the water they felt, without quite knowing why, that they were nearly home. When the council "
    "proposed to switch it off to save money, the whole village came to the meeting, and the proposal was quietly "
    "withdrawn before the end of the evening."
)


@pytest.mark.slow
def test_perplexity_equals_transformers_reading_the_same_file(ours):
    """Our perplexity over windows of 128 tokens every 64 is what the loop of transformers' guide
    computes with transformers' model of the same file, on the same ids."""
    from selfattn.training.evaluate import perplexity

    from helpers.perplexity import guide_perplexity

    path = smollm2()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    ids = ours.tokenizer.encode(PARAGRAPH)
    got = perplexity(ours.model, ids, context=128, stride=64)
    loss, predicted = guide_perplexity(hf, ids, 128, 64)
    expected = torch.tensor(loss, dtype=torch.float64).exp().item()
    print(f"SmolLM2 Q4_1 on {len(ids)} tokens, {got.contexts} contexts: perplexity ours {got.perplexity:.5f}, "
          f"transformers {expected:.5f}, relative difference {abs(got.perplexity / expected - 1):.1e}")
    assert 250 <= len(ids) <= 400 and got.tokens == predicted == len(ids) - 1 and got.contexts >= 4
    assert got.perplexity == pytest.approx(expected, rel=1e-3)
    assert 1 < got.perplexity < 100  # English text: a model that reads it predicts it
