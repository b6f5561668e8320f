# `make run`: set everything up and run the main job on the embedded defaults. `make test`: the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# This machine's pip takes a local CPU wheel for torch==2.13.0; with CUDA, set TORCH_SPEC=torch (or your build).
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000

.PHONY: setup setup-dev run test clean

# Serving needs the package alone; the tests add the dev extras (pytest, transformers, Ray, schemathesis).
# One stamp each, so that `make test` after `make run` installs the extras, and either works from scratch.
setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/specserve models fetch smollm2-135m
	@echo "Starting specserve on http://127.0.0.1:$(PORT)/v1 (Ctrl+C drains and stops). From another shell:"
	@echo "  curl http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"smollm2-135m\", \"messages\": [{\"role\": \"user\", \"content\": \"Explain what a CPU does in one sentence.\"}], \"max_tokens\": 64, \"temperature\": 0.2}'"
	$(VENV)/bin/specserve serve --model smollm2-135m --port $(PORT)

test: setup-dev
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info
