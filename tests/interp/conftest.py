"""Every family a folder can hold, loaded here: the random models of tests/helpers/families.py (every option of
each family on) and a GPT-2, each saved by ``transformers`` and loaded by ``selfattn.io.loading.load``."""
import pytest

from selfattn.io import loading

from helpers.families import CASES, build
from helpers.gpt2 import gpt2_folder

FAMILIES = ["gpt2", *CASES]


@pytest.fixture(scope="session", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, folder, our float32 model in eval mode)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        gpt2_folder(folder, n_layer=2, n_head=4, n_embd=64)
    else:
        build(request.param).save_pretrained(folder)
    return request.param, folder, loading.load(folder).model.eval()
