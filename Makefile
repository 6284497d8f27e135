# The README's two commands: `make demo` and `make test`.
.PHONY: setup demo test test-heavy
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m vllm_pypto.demo

test: setup
	$(PY) -m pytest

test-heavy: setup
	$(PY) -m pytest -m heavy
