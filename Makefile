# minillm: every target installs what it needs first, once (stamps in .venv record it).
#   make serve  - the main job: the OpenAI-compatible server on http://127.0.0.1:8000 (trains the cpu model on first use)
#   make test   - the whole suite: unit tests, then every notebook under nbval
#   make lab    - JupyterLab on notebooks/
#   make book   - the HTML book, offline, into _build/html
#   make loadtest - a load sweep against a running server (start one with make serve first)
#   make router - the router on http://127.0.0.1:8080 over two local replicas of the server (chapter 14)
#   make bench  - the engine benchmark (every generation method, one workload) into benchmarks/results

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --progress-bar off --quiet
BASE   := $(VENV)/.installed-base
DEV    := $(VENV)/.installed-dev

.PHONY: serve test test-unit test-notebooks lab book bench loadtest router clean

serve: $(BASE)
	$(PY) -m server

test: test-unit test-notebooks

test-unit: $(DEV)
	MINILLM_QUICK=1 $(PY) -m pytest tests/

test-notebooks: $(DEV)
	MINILLM_QUICK=1 $(PY) -m pytest --nbval-lax --nbval-current-env notebooks/

lab: $(DEV)
	$(PY) -m jupyter lab notebooks/

LOADTEST_ARGS ?= --sweep 2,4,8,16,32,64,inf --num-prompts 64 --dataset corpus --slo ttft=500ms,tpot=50ms
loadtest: $(BASE)
	$(PY) -m server.loadgen --url http://127.0.0.1:8000 $(LOADTEST_ARGS)

router: $(BASE)
	$(PY) -m server.router --spawn 2 --policy load-aware

bench: $(DEV)
	$(PY) -m minillm.bench engine

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
