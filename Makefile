# Two entry points, each doing all set-up on a fresh machine:
#   make demo   the main job: the seed's worked example, then train a tiny GPT (~70 s) and sample from it
#   make test   the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU wheel; pip never resolves an unpinned torch here.
TORCH  := torch==2.13.0

.PHONY: demo test setup clean

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

demo: setup
	$(BIN)/selfattn demo
	rm -rf runs/tiny
	$(BIN)/selfattn train --preset tiny --out runs/tiny
	$(BIN)/selfattn sample --ckpt runs/tiny --prompt "The " --max-new-tokens 300 --seed 0

test: setup $(CHROMIUM)
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
