# The README's commands. `make test` and `make generate` each do all set-up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch comes from the CPU wheel on local disk; the constraint keeps every later install on it,
# so no dependency can pull a CUDA build.
TORCH_WHEELS ?= /opt/wheels
TORCH_PIN := torch==2.13.0
FIND_LINKS := $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS),)
TEST_PACKS ?= smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
PROMPT ?= Write a Python function that checks whether a string is a palindrome.

.PHONY: venv install generate serve test lint bench loadtest models fetch-test-packs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q $(FIND_LINKS) "$(TORCH_PIN)"
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	$(PIP) install -q $(FIND_LINKS) -c $(VENV)/constraints.txt -e ".[dev]"
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), 'torch ' + torch.__version__ + ', not 2.13.0'"
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m serve_app.native_build
	touch $@

venv install: $(VENV)/.installed

generate: install
	$(VENV)/bin/specserve generate --chat --prompt "$(PROMPT)"

# The OpenAI-compatible API on a local Ray cluster (http://127.0.0.1:8000/v1) until Ctrl-C.
serve: install
	$(VENV)/bin/specserve serve

fetch-test-packs: install
	for p in $(TEST_PACKS); do $(VENV)/bin/specserve models fetch $$p || exit 1; done

test: install fetch-test-packs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(VENV)/bin/specserve bench

# The full load matrix (every policy x 1/4/16/32 users, Qwen pair); report in loadtest/results/.
loadtest: install fetch-test-packs
	$(VENV)/bin/specserve loadtest

models: install
	$(VENV)/bin/specserve models list

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
