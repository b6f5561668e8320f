# `make run`: set everything up and run the main job on the embedded defaults. `make test`: the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's pip takes a local CPU wheel for torch==2.13.0; with CUDA, set TORCH_SPEC=torch (or your build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/specserve models fetch smollm2-135m
	@echo "Starting specserve on http://127.0.0.1:8000/v1 (Ctrl+C drains and stops). From another shell:"
	@echo "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"smollm2-135m\", \"messages\": [{\"role\": \"user\", \"content\": \"Write a haiku about CPUs\"}]}'"
	$(VENV)/bin/specserve serve --model smollm2-135m --port 8000

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info
