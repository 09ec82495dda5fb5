import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per xdist worker: no oversubscription of the cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
