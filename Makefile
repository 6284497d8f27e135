# The README's two commands: `make demo` and `make test`.
.PHONY: setup demo test test-slow test-heavy
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m vllm_pypto.demo

test: setup
	$(PY) -m pytest

test-slow: setup
	$(PY) -m pytest -m slow

test-heavy: setup
	$(PY) -m pytest -m heavy
