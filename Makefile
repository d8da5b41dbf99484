# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (a char-level GPT on 2 CPU processes)
#   make test   set up .venv and run the test suite
# and the language-model job:
#   make llm    token shards of the standard library's sources, a small Llama pre-trained on
#               them (2 CPU processes), exported as a Hugging Face folder and loaded back
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo llm test bench setup clean

setup: $(STAMP)

# torch is pinned through constraints.txt so pip never pulls a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshtrain train examples/char_gpt.toml --checkpoint.resume=none

# the standard library's top-level sources: text that is on every machine
STDLIB := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")

llm: $(STAMP)
	$(BIN)/meshtrain prepare $(STDLIB)/*.py --out runs/llm_data --train-tokenizer 4096 \
		--val-fraction 0.05 --overwrite
	$(BIN)/meshtrain train examples/llama_tiny.toml --checkpoint.resume=none
	run=$$(ls -td runs/llama_tiny/2*/ | head -1); \
	$(BIN)/meshtrain export $${run}checkpoints/final --hf $${run}hf --tokenizer $$run && \
	ln -sfn $$(basename $$run)/hf runs/llama_tiny/hf && \
	$(BIN)/python examples/generate_hf.py runs/llama_tiny/hf "def "

# -ra: the summary names every skipped test with its reason (and every failure; a lone -rs
# would replace pyproject's -ra and leave failures out). With CI set a skip for want of a
# program, server or package fails instead (tests/ci_skips.py); gpu tests skip.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=10 -ra

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
