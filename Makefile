PYTHON ?= python3
# The CPU build of torch that lies on this machine kind's disk; a host that already has
# torch (e.g. a CUDA build) keeps its own: install only runs pip for torch when it is missing.
# constraints.txt pins the versions the suite was run with (torch is not pinned there).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install reference-packages test test-unit test-fast test-gpu train train-reward train-grpo train-dpo train-dreambooth train-controlnet smoke-gpu bench style quality clean

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e ".[test]" -c constraints.txt

# The authors' packages that the hpsv2 and imagereward tests score against, in a folder of the
# tests' own (tests/reference_imports.py puts it on sys.path inside the tests that read them):
# never in the environment, where timm without torchvision breaks `accelerate launch` (accelerate's
# CLI imports timm when it is installed). Without their dependencies, which pull torchvision, whose
# registry wheel does not import beside the CPU build of torch 2.13. Every test target needs it.
REFERENCE_PACKAGES = open_clip_torch timm image-reward fairscale ftfy wcwidth regex
REFERENCE_DIR = tests/.reference_packages
reference-packages: $(REFERENCE_DIR)/.installed
$(REFERENCE_DIR)/.installed: constraints.txt
	rm -rf $(REFERENCE_DIR)
	$(PYTHON) -m pip install --no-deps --target $(REFERENCE_DIR) -c constraints.txt $(REFERENCE_PACKAGES)
	touch $@

# the fast tier with FAST_WORKERS pytest-xdist workers, then the e2e (script launches: 2 ranks
# each, which is what a 2-core machine holds) and gpu tiers in one process; both always run
test: reference-packages
	$(PYTHON) -m pytest tests -q -m "unit or multirank" -n $(FAST_WORKERS); fast=$$?; \
	$(PYTHON) -m pytest tests -q -m "e2e or gpu" --durations=15; e2e=$$?; \
	test $$fast -eq 0 -a $$e2e -eq 0

# the unit tier alone (single process, under two minutes)
test-unit: reference-packages
	$(PYTHON) -m pytest tests -q -m unit

# the fast tier: unit and multirank (real ranks through the harness, forked from a preloaded
# server), no script launches; FAST_WORKERS pytest-xdist workers (4:10 with 2 on a 2-core machine,
# 5:44 in one process)
FAST_WORKERS ?= 2
test-fast: reference-packages
	$(PYTHON) -m pytest tests -q -m "unit or multirank" -n $(FAST_WORKERS)

# GPU hosts: the gpu tier alone (bf16 ZeRO-3 end to end on every GPU, NCCL); skipped without CUDA.
# `make test` runs it too; the other tiers keep their ranks on the CPU there.
test-gpu: reference-packages
	$(PYTHON) -m pytest tests -q -m gpu

# make train MODEL=sdxl|flux|sd3 trains the SDXL, Flux.1 or SD3-architecture default instead.
# The default runs take one process per GPU on a CUDA host, else 2 CPU ranks (diffusers_zero3/runtime/launch.py);
# NUM_PROCESSES=N overrides.
# BUCKETS=1: an image family on landscape and portrait images with --use_aspect_ratio_buckets.
# CONTEXT_PARALLEL=K: each sample's tokens split over groups of K ranks (MODEL=wan; a denoiser with a context-parallel plan).
MODEL ?= sd
BUCKETS ?= 0
CONTEXT_PARALLEL ?= 1
train:
	PYTHON=$(PYTHON) MODEL=$(MODEL) BUCKETS=$(BUCKETS) CONTEXT_PARALLEL=$(CONTEXT_PARALLEL) bash scripts/train_default.sh

train-reward:
	PYTHON=$(PYTHON) bash scripts/train_reward_default.sh

# make train-grpo MODEL=wan: video RL (Flow-GRPO) on a tiny Wan 2.1's 5-frame clips instead of the tiny SD3
train-grpo:
	PYTHON=$(PYTHON) MODEL=$(MODEL) bash scripts/train_grpo_default.sh

train-dpo:
	PYTHON=$(PYTHON) bash scripts/train_dpo_default.sh

# DreamBooth with prior preservation, the UNet and the text encoder each its own ZeRO-3 engine
train-dreambooth:
	PYTHON=$(PYTHON) bash scripts/train_dreambooth_default.sh

# a ControlNet (its own ZeRO-3 engine) beside the frozen, sharded UNet, on shape masks
train-controlnet:
	PYTHON=$(PYTHON) bash scripts/train_controlnet_default.sh

# GPU hosts: each training script for a few steps on every GPU (every model family, placements, bf16,
# reward, DPO, DreamBooth, ControlNet, offload, resume on the same and on another number of GPUs), and
# SD 1.5's UNet at its real size under ZeRO-3 against DDP at N=1 (time per step, device peak), each
# under a timeout; a table to outputs/smoke-gpu/table.md. SMOKE_CASES=a,b runs a subset
# (python scripts/smoke_gpu.py --list). Exits 2 on a host without CUDA.
smoke-gpu:
	@$(PYTHON) scripts/smoke_gpu.py

bench:
	$(PYTHON) -m benchmarks.run

style:
	$(PYTHON) -m ruff check --fix diffusers_zero3 scripts tests benchmarks examples
	$(PYTHON) -m ruff format diffusers_zero3 scripts tests benchmarks examples

quality:
	$(PYTHON) -m ruff check diffusers_zero3 scripts tests benchmarks examples
	$(PYTHON) -m ruff format --check diffusers_zero3 scripts tests benchmarks examples

clean:
	rm -rf build *.egg-info .pytest_cache outputs
