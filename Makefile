# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (a char-level GPT on 2 CPU processes)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench setup clean

setup: $(STAMP)

# torch is pinned through constraints.txt so pip never pulls a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshtrain train examples/char_gpt.toml --checkpoint.resume=none

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
