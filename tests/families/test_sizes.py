"""A config.json (or a GGUF file's metadata, read as one) whose sizes its weights do not hold is
refused by :func:`selfattn.families.empty` in one line naming the file and the field, before
anything is allocated: not a hang building a billion layers, not an allocator's traceback. The
same files undamaged build and load (the controls)."""
import json

import gguf
import pytest

from selfattn import families
from selfattn.formats import gguf as formats_gguf
from selfattn.formats import hf_folder
from selfattn.model import GPT

from helpers import gguf_files
from helpers.families import CASES, build


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every family's folder, saved once; tests damage copies of its config.json."""
    saved = {}
    for case in CASES:
        saved[case] = tmp_path_factory.mktemp(case)
        build(case).save_pretrained(saved[case])
    return saved


def damaged(folder, tmp_path, **changes):
    """A copy of ``folder`` whose config.json has ``changes`` (None: the key left out)."""
    copy = tmp_path / folder.name
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({k: v for k, v in {**config, **changes}.items() if v is not None}))
    return copy


def empty(folder):
    """The model of ``folder`` as the loader builds it, before filling it."""
    hf = hf_folder.config(folder)
    family = families.FAMILIES[hf["model_type"]]
    return families.empty(family, hf, hf_folder.Safetensors(folder), str(folder), str(folder / "config.json"))


@pytest.fixture
def nothing_allocated(monkeypatch):
    def allocate(config):
        raise AssertionError(f"allocated a model of {config}")
    monkeypatch.setattr(GPT, "empty", allocate)


@pytest.mark.parametrize("case", list(CASES))
def test_more_layers_than_the_weights_hold_are_refused_in_every_family(case, folders, tmp_path, nothing_allocated):
    key = "n_layer" if case == "bloom" else "num_hidden_layers"  # BLOOM's config.json names it so
    folder = damaged(folders[case], tmp_path, **{key: 10 ** 9})
    with pytest.raises(ValueError) as e:
        empty(folder)
    assert str(e.value) == f"{folder / 'config.json'}: {key} is 1000000000, but the weights hold 3 layers"


@pytest.mark.parametrize("case", list(CASES))
def test_every_family_s_undamaged_folder_builds_and_loads(case, folders):  # the control
    folder = folders[case]
    model = empty(folder)
    hf = hf_folder.config(folder)
    families.load(families.FAMILIES[hf["model_type"]], hf_folder.Safetensors(folder), model, str(folder))
    assert model.config.n_layer == 3 and model.wte.weight.shape == (128, 64)


@pytest.mark.parametrize("changes, words", [
    (dict(hidden_size=10 ** 7), "vocab_size 128 and hidden_size 10000000 make model.embed_tokens.weight "
                                "(128, 10000000), but {folder} holds it as (128, 64)"),
    (dict(vocab_size=10 ** 12), "vocab_size 1000000000000 and hidden_size 64 make model.embed_tokens.weight "
                                "(1000000000000, 64), but {folder} holds it as (128, 64)"),
    (dict(vocab_size=100), "vocab_size 100 and hidden_size 64 make model.embed_tokens.weight (100, 64), but "
                           "{folder} holds it as (128, 64)"),  # the embedding is larger: named once
    (dict(num_attention_heads=2 ** 40, head_dim=None),  # no head_dim: a head is hidden_size / heads
     "hidden_size 64 is not divisible by num_attention_heads 1099511627776"),
    (dict(num_attention_heads=7, hidden_size=576, head_dim=None),
     "hidden_size 576 is not divisible by num_attention_heads 7"),
])
def test_sizes_the_weights_do_not_hold_are_refused_naming_the_field(changes, words, folders, tmp_path,
                                                                     nothing_allocated):
    folder = damaged(folders["mistral"], tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        empty(folder)
    assert str(e.value) == f"{folder / 'config.json'}: {words.format(folder=folder)}"


@pytest.mark.parametrize("changes, words", [
    (dict(num_attention_heads=2 ** 40), "model.layers.0.self_attn.o_proj.weight (64, 128) instead of "
                                        "(64, 35184372088832)"),  # with a head_dim: the projections' shapes
    (dict(intermediate_size=10 ** 12), "model.layers.0.mlp.down_proj.weight (64, 96) instead of (64, 1000000000000)"),
])
def test_absurd_sizes_are_refused_by_the_tensors_shapes_before_anything_is_allocated(changes, words, folders,
                                                                                      tmp_path, nothing_allocated):
    folder = damaged(folders["llama-llama3-rope"], tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        empty(folder)
    message = str(e.value)
    assert message.startswith(f"the weights in {folder} are not those its config.json describes: of another shape")
    assert words in message and "\n" not in message, message


def test_a_gguf_file_whose_block_count_its_tensors_do_not_hold_is_refused(tmp_path, nothing_allocated):
    hf = gguf_files.random_llama(len(gguf_files.tokenizer()[0]))
    good = formats_gguf.read(gguf_files.write(tmp_path / "good.gguf", hf))
    bad = formats_gguf.read(gguf_files.write(tmp_path / "bad.gguf", hf, metadata={
        "llama.block_count": (2 ** 32 - 1, gguf.GGUFValueType.UINT32)}))
    family, where = families.FAMILIES["llama"], f"{bad.path} (its metadata as a config.json)"
    with pytest.raises(ValueError) as e:
        families.empty(family, bad.config, bad.tensors, str(bad.path), where)
    assert str(e.value) == f"{where}: num_hidden_layers is 4294967295, but the weights hold 2 layers"
    with pytest.raises(AssertionError, match="allocated a model"):  # control: the good file gets as far as allocating
        families.empty(family, good.config, good.tensors, str(good.path), where)
