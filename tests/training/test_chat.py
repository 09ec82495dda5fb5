"""Chat data (selfattn.training.chat): JSON Lines errors naming file and line; SmolLM2's ids equal to
transformers' apply_chat_template; the mask covers exactly the assistant's turns; padded and packed
rows; packing changes no loss and lets no document see another (the causality auditor, with a
negative control); deterministic batches; the cache reused and rebuilt."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from selfattn.audit.causality import check_causal  # noqa: E402
from selfattn.config import GPTConfig  # noqa: E402
from selfattn.io.loading import load  # noqa: E402
from selfattn.tokenizers.chat import ChatTemplate  # noqa: E402
from selfattn.training import chat  # noqa: E402

from helpers.models import scrambled  # noqa: E402
from helpers.smollm2 import smollm2  # noqa: E402

TWO_TURNS = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 × 3, en français ?"},
              {"role": "assistant", "content": "Neuf (9).\nC'est tout."}]
SHORT = [  # conversations of 22, 43 and 31 tokens with SmolLM2's template
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green, or red."}],
    [{"role": "system", "content": "You count."}, {"role": "user", "content": "1 2 3"},
     {"role": "assistant", "content": "4 5 6 7"}],
]
BLOCK = 72  # packed, SHORT * 3 fills rows of 22 + 43, 31 + 22, 43 + 31 and 22 + 43, then 31 tokens


@pytest.fixture(scope="module")
def smol():
    return load(smollm2())


def write_jsonl(path, conversations, blank_lines=False):
    lines = [json.dumps({"messages": m}) for m in conversations]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n", encoding="utf-8")
    return path


def runs(ids, mask):
    """The maximal runs of masked tokens: (start, ids)."""
    out, start = [], None
    for t, m in enumerate(mask + [False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, ids[start:t]))
            start = None
    return out


# --- reading ---------------------------------------------------------------------------------

def test_the_suffix_alone_decides_what_is_chat_data():
    assert chat.is_chat_data("a/b.jsonl") and chat.is_chat_data("B.JSONL")
    assert not any(chat.is_chat_data(p) for p in ("a.json", "a.txt", "jsonl", "a.jsonl.txt", None))


def test_blank_lines_are_skipped_and_lines_counted(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", SHORT, blank_lines=True)
    conversations = chat.read_conversations(path)
    assert [c.line for c in conversations] == [1, 3, 5] and [c.messages for c in conversations] == SHORT


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', "line 2: not JSON (Expecting value at column 15)"),
    ('["a list"]', 'line 2: expected an object with a non-empty list "messages", got ["a list"]'),
    ('{"prompt": "hi"}', 'line 2: expected an object with a non-empty list "messages", got {"prompt": "hi"}'),
    ('{"messages": []}', 'line 2: expected an object with a non-empty list "messages", got {"messages": []}'),
    ('{"messages": "hi"}', 'line 2: expected an object with a non-empty list "messages"'),
    ('{"messages": [{"role": "user"}]}', 'line 2: message 1 must have a "content": a string or a list of text '
                                         'parts, got {"role": "user"}'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}]}',
     'line 2: message 2 must have a "content"'),
    ('{"messages": [{"role": 1, "content": "a"}]}', 'line 2: message 1 must be an object with a string "role"'),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "line 2: message 1: content part 1 is of type 'image_url'; only text parts"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}',
     "line 2: the conversation has no assistant message, so it would teach nothing (roles: system, user)"),
])
def test_a_bad_line_is_refused_naming_the_file_and_the_line(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": SHORT[0]}) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        chat.read_conversations(path)
    assert str(e.value).startswith(f"{path} line 2: ") and message in str(e.value), str(e.value)


@pytest.mark.parametrize("kind, message", [
    ("missing", "does not exist"), ("folder", "is a folder; give one .jsonl file"), ("binary", "looks binary"),
    ("latin1", "is not UTF-8 text"), ("empty", "holds no text (empty)"), ("blank", "holds no text (empty)"),
])
def test_the_file_follows_the_text_corpus_rules(tmp_path, kind, message):
    path = tmp_path / "c.jsonl"
    if kind == "folder":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b'{"messages": []}\x00')
    elif kind == "latin1":
        path.write_bytes('{"messages": "café"}'.encode("latin-1"))
    elif kind in ("empty", "blank"):
        path.write_text("" if kind == "empty" else "\n \n")
    with pytest.raises(ValueError) as e:
        chat.read_conversations(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_text_parts_are_read_as_their_joined_text(tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", [parts, [{"role": "user", "content": "Hi there"},
                                                       {"role": "assistant", "content": "Hello!"}]])
    as_parts, as_text = chat.read_conversations(path)
    assert as_parts.messages == as_text.messages == [{"role": "user", "content": "Hi there"},
                                                      {"role": "assistant", "content": "Hello!"}]


# --- encoding --------------------------------------------------------------------------------

@pytest.mark.parametrize("messages", [TWO_TURNS, MULTI_TURN], ids=["two turns", "system and multi-turn"])
def test_ids_are_transformers_apply_chat_template(smol, messages):
    import tokenizers
    import transformers

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(smol.tokenizer.tok.to_str()), chat_template=smol.chat.source,
        **smol.chat.tokens)
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)["input_ids"]
    ids, mask = chat.encode(messages, smol.tokenizer, smol.chat)
    assert ids == expected and len(mask) == len(ids)
    # bos: SmolLM2's template writes its bos <|im_start|> itself, and it is not added a second time
    assert ids[0] == smol.bos == smol.tokenizer.token_id("<|im_start|>") and ids[1] != smol.bos


@pytest.mark.parametrize("messages", [TWO_TURNS, MULTI_TURN], ids=["two turns", "system and multi-turn"])
def test_the_mask_is_each_answer_with_the_end_of_turn_the_template_writes_after_it(smol, messages):
    """SmolLM2 ends a turn with "<|im_end|>\\n": both are the assistant's (the model learns to stop);
    "<|im_start|>assistant\\n" that opens the turn is not, nor anything of the system or user turns."""
    ids, mask = chat.encode(messages, smol.tokenizer, smol.chat)
    found = runs(ids, mask)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [smol.tokenizer.decode(run) for _, run in found] == [a + "<|im_end|>\n" for a in answers]
    for start, _ in found:
        assert smol.tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n")
    targets = chat.Encoded(1, ids, mask).targets()
    assert targets == [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_it(smol):
    source = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[an earlier answer]"
              "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
    template = ChatTemplate(source, {}, "a test template")
    messages = MULTI_TURN[1:]
    with pytest.raises(ValueError, match=r"^a test template: the chat template does not write a conversation turn "
                                         r"by turn: its text of the 1 message\(s\) before message 2 \(the "
                                         r"assistant's\) with the generation prompt is not a prefix"):
        chat.encode(messages, smol.tokenizer, template)
    ids, mask = chat.encode(messages[:2], smol.tokenizer, template)  # control: its last turn alone is found
    assert [smol.tokenizer.decode(run) for _, run in runs(ids, mask)] == ["4.\n"]


def test_a_conversation_longer_than_a_row_is_refused_naming_its_line_and_both_lengths(smol, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", SHORT)
    conversations = chat.read_conversations(path)
    n = len(chat.encode(SHORT[1], smol.tokenizer, smol.chat)[0])
    with pytest.raises(ValueError, match=rf"^{path} line 2: the conversation is {n} tokens, longer than block_size "
                                         rf"{n - 1}; it is refused, not truncated"):
        chat.encode_all(conversations, smol.tokenizer, smol.chat, where=str(path), block_size=n - 1)
    assert len(chat.encode_all(conversations, smol.tokenizer, smol.chat, where=str(path), block_size=n)) == 3


def test_a_role_the_template_does_not_write_is_refused_naming_the_line_and_the_role(smol, tmp_path):
    human = [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]  # ShareGPT's word
    path = write_jsonl(tmp_path / "c.jsonl", [SHORT[0], human])
    conversations = chat.read_conversations(path)
    with pytest.raises(ValueError, match=rf"^{path} line 2: message 1 has the role 'human', which this model's chat "
                                         rf"template does not write \(its roles: system, user, assistant"):
        chat.encode_all(conversations, smol.tokenizer, smol.chat, where=str(path), block_size=256)
    human[0]["role"] = "user"  # control: the same conversation with a role the template writes
    assert len(chat.encode_all(chat.read_conversations(write_jsonl(path, [SHORT[0], human])), smol.tokenizer,
                               smol.chat, where=str(path), block_size=256)) == 2


def test_a_template_knows_the_tool_role_when_its_source_names_it():
    assert ChatTemplate("{{ messages }}", {}, "plain").roles == ("system", "user", "assistant")
    tools = ChatTemplate("{% if m.role == 'tool' %}{{ m.content }}{% endif %}", {}, "with tools")
    assert tools.roles == ("system", "user", "assistant", "tool")
    with pytest.raises(ValueError, match="message 1 has the role 'tool'"):
        ChatTemplate("{{ messages }}", {}, "plain").render([{"role": "tool", "content": "42"}])


def test_a_conversation_with_nothing_to_predict_is_refused_naming_its_line(smol):
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "a bare template")
    conversations = [chat.Conversation(4, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])]
    with pytest.raises(ValueError, match="^c.jsonl line 4: the assistant's turns hold no token to predict"):
        chat.encode_all(conversations, smol.tokenizer, template, where="c.jsonl", block_size=64)
    conversations[0].messages[1]["content"] = "Hello"  # control
    assert chat.encode_all(conversations, smol.tokenizer, template, where="c.jsonl", block_size=64)


# --- rows ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def encoded(smol):
    return [chat.Encoded(k + 1, *chat.encode(m, smol.tokenizer, smol.chat)) for k, m in enumerate(SHORT * 3)]


def test_unpacked_rows_are_one_conversation_each_padded_on_the_right(encoded):
    x, y, doc_ids = chat.rows(encoded, BLOCK, pack=False)
    assert x.shape == y.shape == (9, BLOCK) and doc_ids is None
    for e, xr, yr in zip(encoded, x, y):
        n = len(e.ids)
        assert xr[:n].tolist() == e.ids and (xr[n:] == chat.PAD).all()
        assert yr[:n].tolist() == e.targets() and (yr[n:] == -100).all()


def test_packed_rows_are_separate_documents(encoded):
    x, y, doc_ids = chat.rows(encoded, BLOCK, pack=True)
    lengths = [len(e.ids) for e in encoded]
    assert x.shape[0] < len(encoded) and (doc_ids[:, 1:] >= doc_ids[:, :-1]).all()  # packed; sorted in each row
    docs = []
    for xr, yr, dr in zip(x, y, doc_ids):
        ids = dr.unique_consecutive().tolist()
        assert ids == list(range(len(ids)))  # a new id at each conversation, the padding (if any) the last
        for d in ids:
            at = (dr == d).nonzero().flatten()
            docs.append((xr[at].tolist(), yr[at].tolist()))
        has = (yr != -100).nonzero().flatten()
        assert (has < BLOCK - 1).all() and (dr[has] == dr[has + 1]).all()  # no target crosses a document
        assert torch.equal(yr[has], xr[has + 1])
    real = [d for d in docs if d[0] != [chat.PAD] * len(d[0]) or d[1] != [-100] * len(d[1])]
    assert real == [(e.ids, e.targets()) for e in encoded]  # every conversation whole, in order
    assert sum(lengths) + sum(len(d[0]) for d in docs if d not in real) == x.numel()  # the rest is padding


@pytest.fixture(scope="module")
def tiny(smol):
    """A random GPT with RoPE over SmolLM2's vocabulary: positions must restart in each document."""
    torch.manual_seed(0)
    return scrambled(GPTConfig(vocab_size=smol.tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16,
                               pos="rope")).eval()


def token_losses(model, x, y, doc_ids=None):
    """The loss of every target, in order: (N,)."""
    logits = model(x.long(), doc_ids=None if doc_ids is None else doc_ids.long())[0]  # (B, T, V)
    losses = F.cross_entropy(logits.flatten(0, 1), y.long().flatten(), reduction="none")  # (B·T,)
    return losses[y.flatten() != -100]


def test_packing_changes_no_loss(tiny, encoded):
    with torch.no_grad():
        alone = token_losses(tiny, *chat.rows(encoded, BLOCK, pack=False)[:2])
        packed = token_losses(tiny, *chat.rows(encoded, BLOCK, pack=True))
        unseparated = token_losses(tiny, *chat.rows(encoded, BLOCK, pack=True)[:2])
    print(f"summed losses: one a row {alone.sum():.6f}, packed {packed.sum():.6f}, packed without doc_ids "
          f"{unseparated.sum():.6f} over {len(alone)} targets")
    assert len(packed) == len(alone) == sum(sum(e.mask[1:]) for e in encoded)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)  # the same targets in the same order
    assert not torch.allclose(unseparated, alone, atol=1e-3)  # negative control: documents see each other


class Packed(nn.Module):
    """The model on one packed row, with or without its doc_ids."""

    def __init__(self, model, doc_ids):
        super().__init__()
        self.model, self.doc_ids = model, doc_ids

    def forward(self, ids):
        return self.model(ids, doc_ids=self.doc_ids)[0]  # (1, T, V)


def test_the_causality_auditor_finds_no_dependence_across_documents(encoded):
    x, _, doc_ids = chat.rows(encoded, BLOCK, pack=True)
    x, doc = x[:1].long() % 61, doc_ids[:1].long()  # (1, T): the first row, 2 conversations and padding
    tiny = scrambled(GPTConfig(vocab_size=61, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16, pos="rope"))
    same = doc[0, :, None] == doc[0, None, :]  # (T, T) output i and input j in one document
    assert doc[0].unique().numel() >= 3
    report = check_causal(Packed(tiny, doc), x, method="both", embedding=tiny.wte)
    print(report)
    assert report.ok  # causal
    for method, dependence in report.dependence.items():
        assert (dependence[~same] == 0).all(), method  # and nothing crosses a document
        assert (dependence[same & torch.ones_like(same).tril()] > 0).float().mean() > 0.99, method  # control: it sees
    leaky = check_causal(Packed(tiny, None), x, method="perturb")  # negative control: the same row without doc_ids
    assert leaky.ok and (leaky.dependence["perturb"][~same & torch.ones_like(same).tril()] > 1e-4).any()


# --- the corpus: cache and batches -------------------------------------------------------------

def prepare(smol, tmp_path, pack=True, **kw):
    return chat.prepare_chat(tmp_path / "tokens", **{**dict(data=tmp_path / "c.jsonl", tokenizer=smol.tokenizer,
                                                             template=smol.chat, block_size=BLOCK, val_fraction=0.25,
                                                             pack=pack), **kw})


@pytest.mark.parametrize("pack", [False, True], ids=["one a row", "packed"])
def test_the_corpus_holds_the_rows_of_its_split(smol, tmp_path, encoded, pack):
    write_jsonl(tmp_path / "c.jsonl", SHORT * 4)  # 12 conversations: 9 train, 3 val
    corpus = prepare(smol, tmp_path, pack=pack)
    for split, part in (("train", encoded[:9]), ("val", (encoded * 2)[9:12])):
        want = chat.rows(part, BLOCK, pack=pack)
        got = getattr(corpus, split)
        assert torch.equal(got.x.long(), want.x.long()) and torch.equal(got.y.long(), want.y.long())
        assert (got.doc_ids is None) == (not pack) and (not pack or torch.equal(got.doc_ids.long(), want.doc_ids))
    lengths = [len(e.ids) for e in encoded]
    assert (corpus.n_train, corpus.n_val) == (sum(lengths[:9]), sum(lengths[:3]))
    assert corpus.train.x.dtype == torch.uint16 and corpus.tokenizer is smol.tokenizer
    assert "12 conversations" in corpus.description and corpus.block_size == BLOCK


def test_batches_depend_only_on_seed_split_and_step_and_parts_tile_them(smol, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", SHORT * 4)
    corpus = prepare(smol, tmp_path, pack=False)  # 9 train rows
    x, y, doc_ids = corpus.batch("train", seed=3, step=2, batch_size=6)
    assert x.shape == y.shape == (6, BLOCK) and x.dtype == y.dtype == torch.int64 and doc_ids is None
    corpus.batch("train", seed=3, step=1, batch_size=6)  # other calls do not shift the stream
    assert torch.equal(corpus.batch("train", seed=3, step=2, batch_size=6)[0], x)
    assert not torch.equal(corpus.batch("train", seed=4, step=2, batch_size=6)[0], x)
    assert not torch.equal(corpus.batch("val", seed=3, step=2, batch_size=6)[0], x)
    parts = [corpus.batch("train", seed=3, step=2, batch_size=6, part=i, parts=3) for i in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    epoch = torch.cat([corpus.batch("train", seed=3, step=s, batch_size=3)[0] for s in (1, 2, 3)])  # (9, BLOCK)
    assert sorted(epoch.tolist()) == sorted(corpus.train.x.long().tolist())  # each row once an epoch
    with pytest.raises(ValueError, match="part 0 of 4"):
        corpus.batch("train", seed=3, step=2, batch_size=6, part=0, parts=4)
    with pytest.raises(ValueError, match="split must be 'train' or 'val', got 'test'"):
        corpus.batch("test", seed=3, step=2, batch_size=6)


def test_packed_batches_carry_their_doc_ids(smol, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", SHORT * 4)
    corpus = prepare(smol, tmp_path)
    x, y, doc_ids = corpus.batch("train", seed=0, step=1, batch_size=4)
    assert doc_ids.shape == x.shape and doc_ids.dtype == torch.int64 and (doc_ids[:, 1:] >= doc_ids[:, :-1]).all()


def test_the_cache_is_reused_and_rebuilt_when_the_file_or_the_recipe_changes(smol, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", SHORT * 4)
    first = prepare(smol, tmp_path)
    meta = tmp_path / "tokens" / "meta.json"
    stamp = meta.stat().st_mtime_ns
    again = prepare(smol, tmp_path)
    assert meta.stat().st_mtime_ns == stamp and again.fingerprint == first.fingerprint  # reused
    assert torch.equal(again.train.x, first.train.x)
    write_jsonl(path, SHORT * 8)  # another file: rebuilt
    changed = prepare(smol, tmp_path)
    assert changed.fingerprint != first.fingerprint and "24 conversations" in changed.description
    stamp = meta.stat().st_mtime_ns
    assert prepare(smol, tmp_path, pack=False).train.doc_ids is None and meta.stat().st_mtime_ns != stamp  # recipe
    with pytest.raises(ValueError, match=r"is not the one this run was trained on \(SHA-256 0123456789ab...\)"):
        prepare(smol, tmp_path, trained_on="0123456789abcdef")


@pytest.mark.parametrize("count, fraction, message", [
    (3, 0.25, "3 conversation(s) with val_fraction 0.25 leave 3 for train and 0 for val"),
    (3, 0.0, "val_fraction must be in (0, 1), got 0.0"),
])
def test_refusals_come_before_anything_is_written(smol, tmp_path, count, fraction, message):
    write_jsonl(tmp_path / "c.jsonl", SHORT[:count])
    with pytest.raises(ValueError) as e:
        prepare(smol, tmp_path, val_fraction=fraction)
    assert message in str(e.value) and not (tmp_path / "tokens").exists()
    with pytest.raises(ValueError, match="line 2: the conversation is 43 tokens, longer than block_size 42"):
        prepare(smol, tmp_path, block_size=42, val_fraction=0.5)
    assert not (tmp_path / "tokens").exists()
