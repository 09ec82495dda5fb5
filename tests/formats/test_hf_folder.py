"""transformers folders beyond their weights: a SentencePiece-style tokenizer.json (Llama 2's and
Mistral's kind) gives transformers' ids and streams byte-exactly; the chat template of
tokenizer_config.json or chat_template.jinja renders as transformers renders it; bos and eos come
from config.json and generation_config.json; the weights are read one tensor at a time."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import transformers  # noqa: E402

from selfattn import families  # noqa: E402
from selfattn.cli import main  # noqa: E402
from selfattn.formats import hf_folder  # noqa: E402
from selfattn.generation.text import text_pieces  # noqa: E402
from selfattn.io import loading  # noqa: E402
from selfattn.tokenizers.bpe import SENTENCEPIECE  # noqa: E402

from helpers.alive import most_alive  # noqa: E402
from helpers.sentencepiece import TEXTS, sentencepiece  # noqa: E402

transformers.logging.set_verbosity_error()
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
            "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
            "{% else %}{% generation %} {{ m['content'] }}{% endgeneration %}{{ eos_token }}{% endif %}"
            "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")


def folder(path, kind="legacy", *, template=TEMPLATE, jinja=None, generation=None):
    """A tiny random Llama saved by transformers, with a SentencePiece-style tokenizer beside it."""
    tok = sentencepiece(kind)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "chat_template": template, "clean_up_tokenization_spaces": False}))
    (path / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.mark.parametrize("kind", ["legacy", "metaspace"])
def test_a_sentencepiece_tokenizer_gives_transformers_ids_and_streams_byte_exactly(kind, tmp_path):
    path = folder(tmp_path / kind, kind)
    ours, theirs = loading.load(path).tokenizer, transformers.AutoTokenizer.from_pretrained(path)
    assert ours is not None and ours.scheme == SENTENCEPIECE
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, special=True) == theirs.encode(text) == [1, *ids]  # the post-processor's bos
        streamed = "".join(text_pieces(ours, ids))  # token by token: the byte-fallback emoji is whole
        if text.startswith(" "):  # one space or two: Llama 2's normalizer prepends one always, Metaspace not here
            assert streamed in (text, " " + text), streamed
        else:  # the space SentencePiece puts first, which a continuation keeps and transformers' decode strips
            assert streamed == " " + text and theirs.decode(ids) == text, (streamed, theirs.decode(ids))
    assert any(ours.tok.id_to_token(i).startswith("<0x") for i in ours.encode("🎉"))  # bytes, not <unk>


def test_the_folder_s_chat_template_renders_as_transformers_renders_it(tmp_path):
    path = folder(tmp_path / "m")
    chat, theirs = loading.load(path).chat, transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And you? 🎉"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "ünï <b>"}}]
    assert chat.render(messages) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.render(messages, tools=tools) == theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert chat.render(messages).startswith("<s>[INST] Hi [/INST] Hello.</s>")
    with pytest.raises(ValueError) as e:  # the template refuses a conversation, naming itself
        chat.render(messages[1:])
    assert str(e.value) == (f"{path / 'tokenizer_config.json'} (chat_template): the chat template refused the "
                            f"conversation (roles must alternate user/assistant)")


def test_chat_template_jinja_comes_before_tokenizer_config_json(tmp_path):
    path = folder(tmp_path / "m", jinja="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert loading.load(path).chat.render(messages) == "<user>hi" == expected


def test_bos_and_eos_come_from_generation_config_json_then_config_json(tmp_path):
    loaded = loading.load(folder(tmp_path / "a"))
    assert (loaded.start_token, loaded.eos) == (1, (2,))  # config.json
    loaded = loading.load(folder(tmp_path / "b", generation={"bos_token_id": 1, "eos_token_id": [2, 5, 10 ** 6]}))
    assert (loaded.start_token, loaded.eos) == (1, (2, 5))  # generation_config.json; an id past the vocabulary dropped


def test_sample_chat_runs_with_the_template_and_without_one_says_so(tmp_path, capsys):
    path = folder(tmp_path / "m")
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(path), "--chat", "the cat", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert main(["sample", "--ckpt", str(path), "--chat", "x", "--prompt", "y"]) == 2
    assert capsys.readouterr().err.endswith("--chat and --prompt are two ways to start: pass one of them\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    assert main(["sample", "--ckpt", str(path), "--chat", "the cat", "--max-new-tokens", "3"]) == 2
    assert capsys.readouterr().err == (
        f"selfattn sample: error: {path} has no chat template (tokenizer_config.json's chat_template, "
        f"chat_template.jinja or a GGUF file's tokenizer.chat_template)\n")


def test_a_folder_s_weights_are_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    path = folder(tmp_path / "m")
    most = most_alive(monkeypatch, hf_folder.Safetensors)
    loaded = loading.load(path)
    assert most[0] == 1, most
    family = families.FAMILIES["llama"]
    state = families.state_dict(family, hf_folder.Safetensors(path), loaded.model, str(path))  # control: all at once
    assert most[0] > len(state) // 2, most


def _spoil(file, find: bytes) -> int:
    """``file`` with a byte that is not UTF-8 (0xff) put after the first ``find``; where it is."""
    raw = file.read_bytes()
    at = raw.index(find) + len(find)
    file.write_bytes(raw[:at] + b"\xff" + raw[at:])
    return at


def test_a_tokenizer_json_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    import tokenizers

    from selfattn.tokenizers import BPETokenizer

    path = folder(tmp_path / "m")
    assert loading.load(path).tokenizer.encode("</s>") == [2]  # control: the file as written, one token
    file = path / "tokenizer.json"
    at = _spoil(file, b'"</s')  # in the eos token: read with the byte replaced, "</s>" was five tokens
    with pytest.raises(Exception):  # the tokenizers library refuses the file too
        tokenizers.Tokenizer.from_file(str(file))
    for read in (loading.load, BPETokenizer.from_folder, hf_folder.tokenizer):
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(e.value) == f"{file}: not UTF-8 text (byte 0xff at offset {at})"


def test_a_chat_template_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = folder(tmp_path / "m", jinja="{% for m in messages %}{{ m.content }}{% endfor %}")
    at = _spoil(path / "chat_template.jinja", b"{{ m")
    with pytest.raises(ValueError) as e:
        loading.load(path)
    assert str(e.value) == f"{path / 'chat_template.jinja'}: not UTF-8 text (byte 0xff at offset {at})"
