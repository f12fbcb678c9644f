# The developer and CI interface. Every target creates .venv and installs into it when needed.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/tiny_cpu.toml
PYTEST_ARGS ?=
# Test processes side by side, each taking whole files (module fixtures are built once); 0 runs serially.
TEST_WORKERS ?= 2

.PHONY: demo rlhf-demo distill-demo test test-fast test-gpu check-onegpu lint fmt golden bench bench-peers bench-gpu bench-gpu-speed clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The embedded default: the tiny offline model learns to reverse short strings on the CPU (~4 min).
demo: $(STAMP)
	$(BIN)/molt-hpc run $(CONFIG)

# The seed's whole pipeline on the CPU: SFT -> reward model -> RL with the reward model in the loop; each
# stage prints its number (held-out SFT loss, held-out pair accuracy, RL reward first -> last quarter).
# Stages resume from runs/tiny-sft, runs/tiny-rm, runs/tiny-rlhf when they exist: delete them to start over.
rlhf-demo: $(STAMP)
	$(BIN)/molt-hpc sft configs/tiny_sft.toml
	$(BIN)/molt-hpc rm train configs/tiny_rm.toml
	$(BIN)/molt-hpc run configs/tiny_rlhf.toml

# On-policy distillation vs RL alone on the CPU (~6 min): the SFT stage's 4-layer model teaches a fresh 2-layer
# student (configs/tiny_distill_cpu.toml); RL alone (configs/tiny_cpu.toml) gets the same wall-clock budget. One
# PNG of both reward curves; the final rewards with their standard errors. The teacher is reused from
# runs/distill-demo/tiny-sft when it exists.
distill-demo: $(STAMP)
	$(BIN)/python bench/distill.py

test: $(STAMP)
	$(BIN)/pytest -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -m "not gpu and not slow and not slurm" -x $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/pytest -m gpu $(PYTEST_ARGS)

# The one-GPU verification (< 8 min): the GPU tests on GPU 0 alone, the CUDA IPC refit benchmark, one
# table; RUNS="runs/x ..." adds each run's time-per-step split. Uses .venv if there is one, else python3.
check-onegpu:
	bash bench/gpu_onegpu_check.sh $(RUNS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Re-record the golden batch scripts of tests/golden/ after an intended change to slurm/ or configs/.
golden: $(STAMP)
	MOLT_GOLDEN_UPDATE=1 $(BIN)/pytest tests/test_slurm_render.py -q

# CPU benchmarks (bench/gpu*.py need a GPU: `make bench-gpu`), then molt-hpc beside TRL (`bench-peers`).
bench: $(STAMP)
	@for b in $$(ls bench/*.py | grep -v '^bench/gpu'); do echo "== $$b"; $(BIN)/python $$b || exit 1; done
	$(MAKE) bench-peers

# molt-hpc beside TRL's GRPOTrainer on CONFIG's task, each run 300 s of wall clock, 3 seeds (~35 min on the
# CPU); installs the pinned TRL into .venv (bench/peers/requirements.txt). docs/peers.md says what it measures.
PEERS_ARGS ?= --budget-s 300 --seeds 0 1 2 --systems trl molt-builtin
bench-peers: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -r bench/peers/requirements.txt
	$(BIN)/python bench/peers/side_by_side.py --config $(CONFIG) --out runs/peers/$$(date +%Y%m%d-%H%M%S) $(PEERS_ARGS)

# GPU benchmarks on two GPUs, one table (BENCH_ARGS="--dry-run" checks them on the CPU).
bench-gpu: $(STAMP)
	$(BIN)/python bench/gpu.py $(BENCH_ARGS)

# The speed subset on one GPU (~5 min): trainer step + host breakdown + loss kernels at 0.5B, engine decode
# variants, vLLM direct vs our front vs our engine.
bench-gpu-speed: $(STAMP)
	$(BIN)/python bench/gpu.py --speed $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
