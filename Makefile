# The README's two commands: `make demo` and `make test`.
.PHONY: setup demo test test-slow test-heavy
PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m vllm_pypto.demo

test: setup
	$(PY) -m pytest

# two workers, a test file at a time each (a file's server fixtures start once): the slow tests
# mostly wait on server start-ups and HTTP
test-slow: setup
	$(PY) -m pytest -m slow -n 2 --dist loadfile

test-heavy: setup
	$(PY) -m pytest -m heavy
