#!/usr/bin/env python
"""`make smoke-gpu`: a few steps of each training script on every GPU of this host, one table.

Each case runs a training script on a tiny default pipeline (``diffusers_zero3.demo``: one
per model family, as ``make train MODEL=...`` builds it, the redness reward model, a
preference dataset, DreamBooth's instance images, ControlNet's shape masks; a tiny CLIP for the
GRPO case's built-in reward) under ``accelerate launch --num_processes N``, N = the GPUs
(``diffusers_zero3.runtime.launch``; ``NUM_PROCESSES`` overrides), for 2 steps (rounds, for
``train_grpo.py``). N is at least 2 wherever the host has 2 GPUs (``case_processes``: one
process runs no collective); a context-parallel case of K takes a multiple of K and is
``skipped`` on a host of fewer than K GPUs. A case's ``mode`` says what more it does:

* ``train``: one launch;
* ``resume``: then a second launch to step 4 from the step-2 checkpoint, on the same N;
* ``reshard``: the second launch on another number of processes M (N -> the largest proper
  divisor of N, or 1 -> 2 when NUM_PROCESSES=1 on a host of several GPUs), processes x batch
  kept, and its log must say it resharded. On a host of one GPU this case is ``skipped``
  ("needs 2 GPUs": NCCL takes one GPU per rank, so a second rank has nowhere to run);
* ``versus-ddp``: SD 1.5's UNet at its published size (859.5 M parameters, the planner's
  config of ``runwayml/stable-diffusion-v1-5``; a tiny VAE and CLIP beside it), bf16, trained
  for 20 steps at N=1 under a plain accelerate config (no DeepSpeed: DDP's config; at one
  process accelerate wraps nothing, so this is the plain model) and under ZeRO-3. The notes
  give ZeRO-3's time per step (steps 2..20, from the trainer's memory report) and device peak
  (``torch.cuda.max_memory_allocated``) against DDP's. At N=1 ZeRO-3 gathers nothing from
  other ranks: what it adds is its per-module hooks, which show as gaps between kernels.
  128 px through the tiny VAE (x2) gives 64 x 64 latents, SD 1.5's at 512 px.

Every launch runs under a timeout: past it the whole process group is killed and the case is
a ``timeout`` (a hang is a failure). The table, case | result | processes | collectives |
seconds | peak device GiB per rank | notes, is printed and written to
``outputs/smoke-gpu/table.md``; each case's log is ``outputs/smoke-gpu/logs/<case>.log``. The peak is the largest ``device peak`` of the
trainer's memory report (``MemoryLog``: torch's ``max_memory_allocated``, the maximum over
ranks), ``n/a`` where the log has none (a script without that report). The data sets are
sized for up to 8 processes of batch 2 (16 video clips, 16 DreamBooth class images, 16 GRPO
samples a round). The collectives column is derived from the case, not read from its log:
``nccl`` when a launch has 2 processes or more (no group on a GPU host is gloo).

    make smoke-gpu                                        # every case
    SMOKE_CASES=sd-bf16-ema-shard-resume,dpo-bf16-lora8 make smoke-gpu
    SMOKE_TIMEOUT=600 make smoke-gpu                      # seconds per launch (default 240)
    python scripts/smoke_gpu.py --list                    # the cases and their flags

Exit status: 0 when every case is ok or skipped, 1 when one failed, 2 without a CUDA GPU or
for an unknown case name.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "outputs" / "smoke-gpu"
ZERO3 = "configs/accelerate_zero3.yaml"
ZERO3_BF16 = "configs/accelerate_zero3_bf16.yaml"
ZERO3_OFFLOAD = "configs/accelerate_zero3_offload.yaml"
SCRIPTS = {
    "t2i": "scripts/train_text_to_image.py",
    "reward": "scripts/train_reward.py",
    "dpo": "scripts/train_dpo.py",
    "dreambooth": "scripts/train_dreambooth.py",
    "controlnet": "scripts/train_controlnet.py",
    "grpo": "scripts/train_grpo.py",
}
MODES = ("train", "resume", "reshard", "versus-ddp")
STEPS = 2
BATCH = 2  # per process
# the demo's extra data of a script (python -m diffusers_zero3.demo DATA --model sd --instances ...)
DEMO_FLAGS = {"dpo": "--preferences", "dreambooth": "--instances", "controlnet": "--controlnet"}
VALIDATION = ["--validation_prompts", "a red circle", "--num_validation_inference_steps", "2"]
# Online RL: 4 prompts x 4 samples a round (up to 8 processes: 2 samples each), scored by the
# demo's python-function reward; a case adds a built-in reward model with {data}/tiny-clip.
REDNESS = "diffusers_zero3.demo.rewards:redness"
GRPO_ROUND = ["--prompts", "a red circle", "a blue square", "a green circle", "a yellow square",
              "--group_size", "4", "--num_inference_steps", "4", "--sample_batch_size", "4"]  # fmt: skip
TINY_CLIP = "tiny-clip"  # under the data folder: a CLIP of the clip_score reward, written by prepare_data

# The real-size case (mode "versus-ddp").
SD15_PIPELINE = "sd15-published-unet"  # under the data folder
PERF_STEPS = 20  # steps 2..20 are timed (the first one warms up)
PERF_RESOLUTION = 128  # the tiny VAE downsamples x2: 64 x 64 latents, SD 1.5's at 512 px
PERF_BATCH = 4
# The DDP side: the same script without DeepSpeed, written next to the logs at run time.
DDP_CONFIG = OUT / "accelerate_ddp_bf16.yaml"
DDP_CONFIG_TEXT = """\
# make smoke-gpu's DDP baseline (written by scripts/smoke_gpu.py): the same script without
# DeepSpeed. At one process accelerate does not wrap the model in DDP (nothing to all-reduce).
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""


@dataclass
class Case:
    """A training script (a key of ``SCRIPTS``) on the pipeline ``tiny-<model>`` (or
    ``pipeline``) under ``config`` with ``flags`` (one string, split as a shell would;
    ``{data}`` stands for the data folder), after
    the family's own placements when ``family_defaults`` (those of ``make train MODEL=...``);
    validation at the last step when ``validate``; ``mode``: see the module docstring."""

    name: str
    script: str
    model: str
    flags: str = ""
    config: str = ZERO3_BF16
    validate: bool = True
    mode: str = "train"
    family_defaults: bool = False
    pipeline: str | None = None  # a folder under the data folder instead of tiny-<model>
    timeout: float | None = None  # seconds per launch; None: SMOKE_TIMEOUT

    def __post_init__(self) -> None:
        if self.script not in SCRIPTS or self.mode not in MODES:
            raise ValueError(f"{self.name}: script {self.script!r} or mode {self.mode!r} is not known")


EMA_SHARD = "--use_ema --text_encoder_placement shard"
CASES = [
    Case("sd-fp32-ema-shard-resume", "t2i", "sd", EMA_SHARD, config=ZERO3, mode="resume"),
    Case("sd-bf16-ema-shard-resume", "t2i", "sd", EMA_SHARD, mode="resume"),
    Case("sdxl-bf16-vae-replicate", "t2i", "sdxl", "--vae_placement replicate"),
    Case("sdxl-bf16-vae-cache", "t2i", "sdxl", "--vae_placement cache"),
    Case("sdxl-bf16-te2-cache", "t2i", "sdxl", "--text_encoder_2_placement cache"),
    Case(
        "sd3-bf16-t5-cache",
        "t2i",
        "sd3",
        "--text_encoder_placement replicate --text_encoder_2_placement replicate "
        "--text_encoder_3_placement cache --max_sequence_length 32",
    ),
    Case(
        "flux-bf16-t5-shard-lora4",
        "t2i",
        "flux",
        "--text_encoder_2_placement shard --rank 4 --max_sequence_length 32",
    ),
    # The families added since: each as `make train MODEL=...` runs it (its own placements:
    # the LLM and VLM text encoders sharded), in bf16, with EMA or LoRA.
    Case("qwenimage-bf16-ema", "t2i", "qwenimage", "--use_ema", family_defaults=True),
    Case("zimage-bf16-ema", "t2i", "zimage", "--use_ema", family_defaults=True),
    Case("flux2-bf16-ema", "t2i", "flux2", "--use_ema", family_defaults=True),
    Case("flux2-klein-bf16-lora4", "t2i", "flux2-klein", "--rank 4", family_defaults=True),
    Case("krea2-bf16-ema", "t2i", "krea2", "--use_ema", family_defaults=True),
    Case("kontext-bf16-ema", "t2i", "kontext", "--use_ema", family_defaults=True),  # editing pairs
    # editing pairs; Qwen2.5-VL (sharded) reads the source images
    Case("qwenimage-edit-bf16-ema", "t2i", "qwenimage-edit", "--use_ema", family_defaults=True),
    Case("nucleusmoe-bf16-ema", "t2i", "nucleusmoe", "--use_ema", family_defaults=True),  # MoE transformer
    Case("ideogram4-bf16-ema", "t2i", "ideogram4", "--use_ema", family_defaults=True),  # two transformers
    # HiDream's Llama comes from its own folder (--component text_encoder_4=...-llama)
    Case("hidream-bf16-ema", "t2i", "hidream", "--use_ema", family_defaults=True),
    Case("wan-bf16-ema", "t2i", "wan", "--use_ema", family_defaults=True),
    Case("wan22-bf16-both-experts", "t2i", "wan22", "--use_ema --train_experts both", family_defaults=True),
    Case("wan22_5b-bf16-ema", "t2i", "wan22_5b", "--use_ema", family_defaults=True),
    Case("hunyuanvideo15-bf16-ema", "t2i", "hunyuanvideo15", "--use_ema", family_defaults=True),
    # video with its sound: Gemma 3 sharded, the audio VAE and vocoder replicated; validation mp4 with audio
    Case("ltx2-bf16-ema", "t2i", "ltx2", "--use_ema", family_defaults=True),
    Case(
        "reward-bf16",
        "reward",
        "sd",
        "--reward_placement shard --use_ema --num_inference_steps 4 --truncated_backprop_steps 1",
        validate=False,  # the reward script has no validation images; it logs the reward per step
    ),
    Case("dpo-bf16-lora8", "dpo", "sd", "--rank 8 --text_encoder_placement shard"),
    # the UNet and the text encoder, each its own ZeRO-3 engine; class images made by every rank
    Case(
        "dreambooth-bf16-text-encoder",
        "dreambooth",
        "sd",
        "--train_text_encoder --text_encoder_lr 1e-4 --with_prior_preservation",
    ),
    # the ControlNet trained beside the frozen UNet, which is a ZeRO-3 inference engine
    Case(
        "controlnet-bf16-unet-shard",
        "controlnet",
        "sd",
        "--unet_placement shard --text_encoder_placement shard",
    ),
    Case(
        "sd-bf16-offload-placements",
        "t2i",
        "sd",
        "--use_ema --text_encoder_placement offload --vae_placement offload",
    ),
    # DeepSpeed builds its CPU Adam op at the first use of optimizer offload: a longer timeout.
    Case("sd-fp32-offload-config", "t2i", "sd", EMA_SHARD, config=ZERO3_OFFLOAD, timeout=480),
    # Online RL on the tiny SD3 (scripts/train_grpo.py): Flow-GRPO, fully fine-tuned beside its
    # frozen reference (a ZeRO-3 inference engine), scored by a python function on each rank's own
    # images and a built-in reward model sharded (a forward of every rank in lockstep)
    Case(
        "grpo-bf16-python-and-sharded-clip-reward",
        "grpo",
        "sd3",
        f"--objective grpo --kl_beta 0.01 --reward {REDNESS} --reward clip_score=0.01 "
        f"--reward_model clip_score={{data}}/{TINY_CLIP} --reward_placement clip_score=shard",
        validate=False,  # no validation images: the log has the reward of each round
    ),
    Case("nft-bf16-lora4", "grpo", "sd3", f"--objective nft --rank 4 --reward {REDNESS}", validate=False),
    # video RL: Wan 2.1's 5-frame clips split over 2 ranks (skipped on a host of one GPU), and
    # Wan 2.2 A14B's two experts (each its own engine; a round trains one on its 2 of the 4 steps)
    Case(
        "grpo-wan-bf16-clips-cp2",
        "grpo",
        "wan",
        f"--objective grpo --reward {REDNESS} --num_frames 5 --context_parallel_size 2",
        validate=False,
    ),
    Case(
        "nft-wan22-bf16-both-experts",
        "grpo",
        "wan22",
        f"--objective nft --reward {REDNESS} --num_frames 5 --timestep_fraction 0.5",
        validate=False,
    ),
    # context parallelism: 2 ranks split each clip's tokens (skipped on a host of one GPU). Ring
    # passes key/value chunks around and needs a backend that returns the log-sum-exp (cuDNN
    # here); Ulysses exchanges heads with an all-to-all on the default backend (native: diffusers
    # lists it as context-parallel)
    Case(
        "wan-bf16-cp2-ring",
        "t2i",
        "wan",
        "--context_parallel_size 2 --context_parallel_mode ring --attention_backend _native_cudnn",
        family_defaults=True,
    ),
    Case(
        "wan-bf16-cp2-ulysses",
        "t2i",
        "wan",
        "--context_parallel_size 2 --context_parallel_mode ulysses",
        family_defaults=True,
    ),
    # several ZeRO-3 engines interleaved under DeepSpeed's async prefetch: Ideogram 4's two
    # transformers trained, one a step in turn (the ControlNet case has the other pair)
    Case("ideogram4-bf16-both-denoisers", "t2i", "ideogram4", "--train_denoisers both", family_defaults=True),
    # a checkpoint of N processes resumed on M (DeepSpeed's universal form, the EMA re-cut)
    Case("sd-bf16-ema-resume-other-n", "t2i", "sd", EMA_SHARD, mode="reshard"),
    # 859.5 M parameters to load and save twice: a longer timeout
    Case(
        "sd15-size-bf16-zero3-vs-ddp",
        "t2i",
        "sd",
        "--text_encoder_placement replicate --vae_placement replicate",
        validate=False,
        mode="versus-ddp",
        pipeline=SD15_PIPELINE,
        timeout=900,
    ),
]


def _train_images(model: str) -> str:
    """The folder of ``model``'s training data under the data folder, as ``demo.prepare_default``
    writes it (``demo.training_data_folder``: LTX-2's clips with sound among them)."""
    from diffusers_zero3.demo import training_data_folder

    return training_data_folder(model)


def family_run_args(model: str, pipeline: Path | str) -> list[str]:
    """The placements of ``make train MODEL=model`` (the family's ``default_run_args``, with
    ``{pipeline}`` the pipeline folder)."""
    from diffusers_zero3.families import family_named

    return [a.format(pipeline=pipeline) for a in family_named(model).default_run_args]


def _data_flags(case: Case, data: Path, run: Path) -> list[str]:
    if case.script == "reward":
        return ["--prompts", "a red circle", "a blue square", "--reward_model_name_or_path", str(data / "redness-reward")]  # fmt: skip
    if case.script == "dpo":
        return ["--dataset_name", str(data / "preferences"), "--center_crop", "--lr_warmup_steps", "0"]
    if case.script == "dreambooth":  # 16 class images: enough rows for 8 processes of 2
        return ["--instance_data_dir", str(data / "instances"), "--instance_prompt", "a photo of sks circle",
                "--class_data_dir", str(run / "class-images"), "--class_prompt", "a photo of a circle",
                "--num_class_images", "16", "--sample_batch_size", "4", "--num_class_inference_steps", "2",
                "--lr_warmup_steps", "0"]  # fmt: skip
    if case.script == "controlnet":
        return ["--dataset_name", str(data / "controlnet-shapes"), "--lr_warmup_steps", "0"]
    if case.script == "grpo":  # samples its own images: prompts and rewards, no dataset
        return list(GRPO_ROUND)
    images = data / _train_images(case.model)
    return ["--train_data_dir", str(images), "--center_crop", "--lr_warmup_steps", "0"]


def case_flags(case: Case, data: Path | str) -> list[str]:
    """``case.flags`` split as a shell would, ``{data}`` replaced by the data folder."""
    return shlex.split(case.flags.replace("{data}", str(data)))


def _validation_flags(case: Case, data: Path) -> list[str]:
    every = ["--validation_steps", str(STEPS), "--num_validation_inference_steps", "2"]
    if case.script == "dreambooth":
        return ["--validation_prompt", "a photo of sks circle", "--num_validation_images", "2", *every]
    if case.script == "controlnet":
        mask = data / "controlnet-shapes-masks" / "circle.png"
        return ["--validation_prompt", "a red circle", "--validation_image", str(mask), *every]
    return [*VALIDATION, "--validation_steps", str(STEPS)]


def case_argv(case: Case, data: Path, run: Path, steps: int, batch: int = BATCH) -> list[str]:
    """The script and its flags for one launch of ``case`` to ``steps`` on the pipelines under
    ``data``, ``batch`` per process, writing ``run``. Checkpoints every ``STEPS`` steps (never
    in the timed steps of a ``versus-ddp`` case)."""
    pipe = data / (case.pipeline or f"tiny-{case.model}")
    timed = case.mode == "versus-ddp"
    resolution, batch = (PERF_RESOLUTION, PERF_BATCH) if timed else (32, batch)
    every = 10 * steps if timed else STEPS  # checkpoints
    argv = [SCRIPTS[case.script], "--pretrained_model_name_or_path", str(pipe), "--output_dir", str(run)]
    argv += ["--resolution", str(resolution), "--train_batch_size", str(batch), "--seed", "0"]
    argv += ["--max_train_steps", str(steps), "--learning_rate", "1e-4", "--checkpointing_steps", str(every)]
    argv += ["--process_group_timeout", "120", "--report_to", "none"]
    argv += _data_flags(case, data, run)
    if case.family_defaults:
        argv += family_run_args(case.model, pipe)
    argv += case_flags(case, data)
    if case.validate:
        argv += _validation_flags(case, data)
    return argv


@dataclass(frozen=True)
class Launch:
    """One ``accelerate launch`` of a case: ``argv`` (the script and its flags) on
    ``num_processes`` under ``config``, to ``steps``; its log must match each of ``expect``."""

    label: str
    config: str
    num_processes: int
    argv: tuple[str, ...]
    steps: int
    expect: tuple[str, ...]


def reshard_counts(num_processes: int, gpus: int) -> tuple[int, int] | None:
    """``(N, M)``: the processes that write the checkpoint and those that resume it, one GPU
    each. N -> the largest proper divisor of N (8 -> 4, 6 -> 3, 2 -> 1, 3 -> 1); 1 -> 2 where
    the host has 2 GPUs; None where it has one (two ranks cannot share a GPU under NCCL)."""
    if num_processes >= 2:
        factor = next(p for p in range(2, num_processes + 1) if num_processes % p == 0)
        return num_processes, num_processes // factor
    return (1, 2) if gpus >= 2 else None


def context_parallel_size(case: Case) -> int:
    """K of the case's ``--context_parallel_size`` (1 without it)."""
    flags = shlex.split(case.flags)
    return int(flags[flags.index("--context_parallel_size") + 1]) if "--context_parallel_size" in flags else 1


def case_processes(case: Case, num_processes: int, gpus: int) -> int | None:
    """The processes of ``case``'s (first) launch on a host of ``gpus`` GPUs, ``num_processes``
    asked (the GPUs, or ``NUM_PROCESSES``); None when the host cannot run it.

    At least 2 wherever the host has 2 GPUs, ``NUM_PROCESSES=1`` included: one process runs no
    collective at all, which is what the matrix is for. A context-parallel case of K takes a
    multiple of K (K ranks split one sample; K GPUs at least, one a rank under NCCL). A
    ``reshard`` case keeps ``num_processes`` (``reshard_counts`` picks its two counts: 1 -> 2
    there); a ``versus-ddp`` case is 1 process by design (ZeRO-3's hooks against the plain model).
    """
    k = context_parallel_size(case)
    if k > 1:
        return k * max(1, min(num_processes, gpus) // k) if gpus >= k else None
    if case.mode == "versus-ddp":
        return 1
    if case.mode == "reshard":
        return num_processes
    return max(num_processes, 2) if gpus >= 2 else num_processes


def skip_reason(case: Case, num_processes: int, gpus: int) -> str | None:
    """Why ``case`` cannot run on this host (None when it can)."""
    if case.mode == "reshard" and reshard_counts(num_processes, gpus) is None:
        return f"needs 2 GPUs (a checkpoint of 1 process resumed on 2; this host has {gpus})"
    k = context_parallel_size(case)
    if case_processes(case, num_processes, gpus) is None:
        return f"needs {k} GPUs (context parallelism of {k}: {k} ranks split each sample, one GPU each; this host has {gpus})"  # fmt: skip
    return None


def collective_backends(launches: list[Launch]) -> str:
    """The collective backends ``launches`` exercise, from their process counts (the logs do not
    say): NCCL for the ZeRO-3 engines, the accelerator and the context-parallel groups wherever
    a launch has 2 processes or more; ``none`` when every launch is one process. No group on a
    GPU host is gloo (``runtime.accelerator`` asks for gloo only on a host without CUDA)."""
    return "nccl" if any(launch.num_processes > 1 for launch in launches) else "none"


def _stepped(steps: int) -> str:
    return rf"\bstep {steps} (loss|reward) "


def plan_launches(case: Case, data: Path, run: Path, num_processes: int, gpus: int) -> list[Launch]:
    """The launches of ``case`` with ``num_processes`` per launch on a host of ``gpus`` GPUs
    (call ``skip_reason`` first)."""
    resumed = rf"resumed from \S*checkpoint-{STEPS} at step {STEPS}\b"
    resume = ["--resume_from_checkpoint", "latest"]

    def launch(label, config, n, argv, steps, *expect) -> Launch:
        return Launch(label, config, n, tuple(argv), steps, (_stepped(steps), *expect))

    if case.mode == "versus-ddp":  # N=1: no collective, only ZeRO-3's hooks against the plain model
        return [
            launch(label, config, 1, case_argv(case, data, run / label, PERF_STEPS), PERF_STEPS)
            for label, config in (("ddp", str(DDP_CONFIG)), ("zero3", case.config))
        ]
    if case.mode == "reshard":
        n, m = reshard_counts(num_processes, gpus)
    else:
        n = m = case_processes(case, num_processes, gpus)
    first = launch("train", case.config, n, case_argv(case, data, run, STEPS), STEPS)
    if case.mode == "train":
        return [first]
    # on another number of processes, processes x batch kept: the samples of the checkpoint's
    # epoch fill whole steps of the resumed run
    again = case_argv(case, data, run, 2 * STEPS, batch=BATCH * n // m) + resume
    expect = (resumed, rf"written by {n} processes; resharded for {m}\b") if m != n else (resumed,)
    return [first, launch("resume", case.config, m, again, 2 * STEPS, *expect)]


def launch_command(launch: Launch, port: int) -> list[str]:
    """The ``accelerate launch`` command line of ``launch`` (rendezvous on ``port``)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch.config,
            "--num_processes", str(launch.num_processes), "--main_process_port", str(port), *launch.argv]  # fmt: skip


def write_sd15_pipeline(folder: Path) -> Path:
    """An SD pipeline whose UNet is SD 1.5's at its published size (the planner's config of
    runwayml/stable-diffusion-v1-5: 859.5 M parameters, 686 tensors, 391 modules, random
    weights, fp32 safetensors), with the tiny VAE and a 2-layer CLIP of SD 1.5's width (768)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusers_zero3.demo.pipelines import sd_scheduler, tiny_component_configs, tiny_vae_config
    from diffusers_zero3.demo.tokenizers import local_clip_tokenizer
    from diffusers_zero3.families import SD
    from diffusers_zero3.runtime.zero3 import zero3_init_disabled

    text = tiny_component_configs(width=32, cross_dim=768)["text_encoder"]
    with zero3_init_disabled():
        torch.manual_seed(0)
        unet = UNet2DConditionModel(**sd15_unet_config())
        vae = AutoencoderKL(**tiny_vae_config(32))
        text_encoder = CLIPTextModel(CLIPTextConfig(**text))
    pipe = SD.pipeline(unet, vae, {"text_encoder": text_encoder}, {"text_encoder": local_clip_tokenizer(folder)},
                       sd_scheduler())  # fmt: skip
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_tiny_clip(folder: Path) -> Path:
    """A tiny CLIP (2 layers, width 32, 32 px images) with its tokenizer and image processor: a
    folder the built-in ``clip_score`` (and ``pickscore``) reward loads (tests/test_reward_registry.py
    builds the same)."""
    import torch
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from diffusers_zero3.demo.pipelines import tiny_clip_config
    from diffusers_zero3.demo.tokenizers import write_clip_tokenizer
    from diffusers_zero3.runtime.zero3 import zero3_init_disabled

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8, projection_dim=16)  # fmt: skip
    with zero3_init_disabled():
        torch.manual_seed(0)
        config = CLIPConfig(text_config=tiny_clip_config(hidden_size=32, projection_dim=16), vision_config=vision,
                            projection_dim=16, logit_scale_init_value=3.0)  # fmt: skip
        CLIPModel(config).eval().save_pretrained(folder)
    write_clip_tokenizer(folder)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor.save_pretrained(folder)
    return Path(folder)


def sd15_unet_config() -> dict:
    """SD 1.5's UNet config (the keys that set its shapes; the others are diffusers' defaults,
    the published values)."""
    from diffusers_zero3.families import SD

    published = next(p for p in SD.published() if p.hub_id == "runwayml/stable-diffusion-v1-5")
    return dict(published.components["unet"][2])


def prepare_data(cases: list[Case], data: Path, log_path: Path) -> bool:
    """Make (once; later runs reuse them) the tiny pipelines, datasets and reward model the
    cases need with ``python -m diffusers_zero3.demo`` (and SD 1.5's UNet for a ``versus-ddp``
    case, the tiny CLIP of a case that names ``{data}/tiny-clip``), the output appended to ``log_path``. False when it failed."""
    for model in sorted({c.model for c in cases}):
        scripts = {c.script for c in cases if c.model == model}
        argv = [sys.executable, "-m", "diffusers_zero3.demo", str(data), "--model", model]
        argv += [flag for script, flag in DEMO_FLAGS.items() if script in scripts]
        if run_launch(argv, dict(os.environ), log_path, timeout=600) != 0:
            return False
    clip = data / TINY_CLIP
    if any(f"{{data}}/{TINY_CLIP}" in c.flags for c in cases) and not (clip / "config.json").exists():
        argv = [sys.executable, str(Path(__file__).resolve()), "--write-tiny-clip", str(clip)]
        if run_launch(argv, dict(os.environ), log_path, timeout=600) != 0:
            return False
    sd15 = data / SD15_PIPELINE
    if any(c.mode == "versus-ddp" for c in cases) and not (sd15 / "model_index.json").exists():
        argv = [sys.executable, str(Path(__file__).resolve()), "--write-sd15-pipeline", str(sd15)]
        if run_launch(argv, dict(os.environ), log_path, timeout=600) != 0:
            return False
    return True


# MemoryLog.format's "device peak X MiB" (torch's max_memory_allocated, maximum over ranks).
_DEVICE_PEAK = re.compile(r"device peak\D{0,12}?([0-9.]+)\s*(GiB|MiB|KiB|GB|MB|KB)\b", re.IGNORECASE)
_UNIT = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 1e9, "mb": 1e6, "kb": 1e3}
# MemoryLog.format's line of the last phase: "training done  RSS ... MiB  peak ... MiB (+ ...)  <s> s"
_TRAINING_DONE = re.compile(r"^\s*training done\s+RSS\s+[0-9.]+ MiB\s+peak\s+[0-9.]+ MiB \(\+\s*[0-9.]+\)\s+([0-9.]+) s", re.M)  # fmt: skip


def device_peak_gib(log: str) -> float | None:
    """The largest ``device peak <x> <unit>`` in a training log, in GiB (None if absent)."""
    values = [float(v) * _UNIT[u.lower()] / 2**30 for v, u in _DEVICE_PEAK.findall(log)]
    return max(values) if values else None


def seconds_per_step(log: str, steps: int) -> float | None:
    """Seconds per step of steps 2..``steps`` of a training log: its memory report's last
    phase (``training done``) runs from the first optimizer step to the end of the loop."""
    found = _TRAINING_DONE.findall(log)
    return float(found[-1]) / (steps - 1) if found and steps > 1 else None


def versus_ddp_note(ddp_log: str, zero3_log: str, steps: int) -> str:
    """The table's note of a ``versus-ddp`` case (both runs to ``steps``): ZeRO-3's time per
    step and device peak against DDP's (``n/a`` for a number a log lacks)."""

    def ratio(ours: float | None, theirs: float | None, unit: str, digits: int) -> str:
        if ours is None or theirs is None or theirs <= 0:
            return f"n/a ({_num(ours, digits)} / {_num(theirs, digits)} {unit})"
        return f"{ours / theirs:.2f} x ({ours:.{digits}f} / {theirs:.{digits}f} {unit})"

    step = ratio(seconds_per_step(zero3_log, steps), seconds_per_step(ddp_log, steps), "s", 3)
    peak = ratio(device_peak_gib(zero3_log), device_peak_gib(ddp_log), "GiB", 2)
    return f"ZeRO-3 / DDP at N=1: time per step {step}, device peak {peak}"


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run_launch(argv: list[str], env: dict[str, str], log_path: Path, timeout: float) -> int | None:
    """Run one launch in a new session, its output appended to ``log_path``; kill its whole
    process group past ``timeout`` seconds. The exit code, or None on a timeout."""
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\n[smoke-gpu] killed after {timeout:.0f} s (a hang or too slow)\n")
            return None
        except BaseException:  # Ctrl-C: leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def run_case(case: Case, num_processes: int, gpus: int, env: dict, data: Path, timeout: float) -> dict:
    """Run ``case``'s launches one after the other (the first failure stops it); returns
    ``{result, seconds, peak, note, processes, backends}``, result ``ok``, ``FAIL``, ``timeout`` or
    ``skipped``; processes ``N`` (``N -> M`` for a resume on M), backends ``collective_backends``'s."""
    from diffusers_zero3.testing import free_port

    reason = skip_reason(case, num_processes, gpus)
    if reason:
        return {"result": "skipped", "seconds": 0.0, "peak": None, "note": reason, "processes": "-",
                "backends": "-"}  # fmt: skip
    run, log_path = OUT / "runs" / case.name, OUT / "logs" / f"{case.name}.log"
    shutil.rmtree(run, ignore_errors=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    if case.mode == "versus-ddp":
        DDP_CONFIG.parent.mkdir(parents=True, exist_ok=True)
        DDP_CONFIG.write_text(DDP_CONFIG_TEXT)
    launches = plan_launches(case, data, run, num_processes, gpus)
    processes = " -> ".join(str(launch.num_processes) for launch in launches)
    start, result, note, logs = time.monotonic(), "ok", "", {}
    for launch in launches:
        offset = len(log_path.read_text())
        rc = run_launch(launch_command(launch, free_port()), env, log_path, timeout)
        logs[launch.label] = log = log_path.read_text()[offset:]
        missing = [p for p in launch.expect if not re.search(p, log)]
        if rc is None:
            result, note = "timeout", f"{launch.label}: killed after {timeout:.0f} s"
        elif rc != 0:
            result, note = "FAIL", f"{launch.label}: exit code {rc}"
        elif missing:
            result, note = "FAIL", f"{launch.label}: exit code 0 but no match for {missing[0]!r} in its log"
        if result != "ok":
            break
    peak = device_peak_gib(log_path.read_text())
    if result == "ok" and case.mode == "reshard":
        note = f"{launches[0].num_processes} -> {launches[1].num_processes} processes"
    elif result == "ok" and case.mode == "versus-ddp":
        note = versus_ddp_note(logs["ddp"], logs["zero3"], launches[0].steps)
        peak = device_peak_gib(logs["zero3"])
    return {"result": result, "seconds": time.monotonic() - start, "peak": peak, "note": note,
            "processes": processes, "backends": collective_backends(launches)}  # fmt: skip


def format_table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table: case | result | processes | collectives | seconds | peak device GiB per
    rank | notes."""
    lines = ["| case | result | processes | collectives | seconds | peak device GiB per rank | notes |",
             "|---|---|---:|---|---:|---:|---|"]  # fmt: skip
    for name, r in rows:
        peak = "n/a" if r["peak"] is None else f"{r['peak']:.2f}"
        lines.append(f"| {name} | {r['result']} | {r.get('processes', '-')} | {r.get('backends', '-')} | "
                     f"{r['seconds']:.1f} | {peak} | {r.get('note', '')} |")  # fmt: skip
    return "\n".join(lines)


def describe(case: Case) -> str:
    """One line of ``--list``: the script, pipeline, config, mode and the case's own flags."""
    pipe = f"<data>/{case.pipeline or 'tiny-' + case.model}"
    defaults = family_run_args(case.model, pipe) if case.family_defaults else []
    flags = [*defaults, *case_flags(case, "<data>")]
    config = f"{DDP_CONFIG.name} vs {case.config}, N=1" if case.mode == "versus-ddp" else case.config
    mode = {"resume": " [resume on N]", "reshard": " [resume on another N]"}.get(case.mode, "")
    return f"{SCRIPTS[case.script]} {pipe} {config}{mode} {shlex.join(flags)}".rstrip()


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("torch", "deepspeed", "accelerate", "diffusers", "transformers"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} missing")
    return ", ".join(parts)


def select_cases(names: str) -> list[Case]:
    """The cases named in ``names`` (comma-separated, in the matrix's order); all when empty.
    Raises ValueError for an unknown name."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(c.name for c in CASES)}")
    return [c for c in CASES if not wanted or c.name in wanted]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="make smoke-gpu (see the module docstring)")
    parser.add_argument("--list", action="store_true", help="print the cases and their flags")
    # prepare_data's step for a versus-ddp case (a subprocess: its output goes to the data log)
    parser.add_argument("--write-sd15-pipeline", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--write-tiny-clip", metavar="FOLDER", help=argparse.SUPPRESS)  # a grpo case's reward
    cli = parser.parse_args(argv)
    if cli.list:
        for case in CASES:
            print(f"{case.name}: {describe(case)}")
        return 0
    if cli.write_sd15_pipeline:
        print(f"pipeline: {write_sd15_pipeline(Path(cli.write_sd15_pipeline))}")
        return 0
    if cli.write_tiny_clip:
        print(f"reward model: {write_tiny_clip(Path(cli.write_tiny_clip))}")
        return 0
    from diffusers_zero3.runtime.launch import cuda_device_count, launch_settings

    # DS_ACCELERATOR=cpu (left over from a CPU run) would ask for CPU ranks: these cases are for GPUs.
    env = {k: v for k, v in os.environ.items() if not (k == "DS_ACCELERATOR" and v == "cpu")}
    try:
        settings = launch_settings(env)
        cases = select_cases(os.environ.get("SMOKE_CASES", ""))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if settings.device != "cuda":
        print("error: make smoke-gpu needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    env.update(settings.env)
    timeout = float(os.environ.get("SMOKE_TIMEOUT", 240))
    n, gpus = settings.num_processes, cuda_device_count()
    data = OUT / "data"
    print(f"smoke-gpu: {len(cases)} case(s), {n} GPU process(es) on {gpus} GPU(s); {_versions()}", flush=True)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    if not prepare_data(cases, data, OUT / "logs" / "data.log"):
        print(f"error: making the tiny pipelines failed: {OUT / 'logs' / 'data.log'}", file=sys.stderr)
        return 1
    rows = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} ...", end=" ", flush=True)
        r = run_case(case, n, gpus, env, data, case.timeout or timeout)
        print(f"{r['result']} ({r['seconds']:.1f} s){': ' + r['note'] if r['note'] else ''}", flush=True)
        rows.append((case.name, r))
    table = format_table(rows)
    header = f"make smoke-gpu: {n} GPU process(es) on {gpus} GPU(s); {_versions()}"
    (OUT / "table.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{table}\n\ntable: {OUT / 'table.md'}")
    failed = [name for name, r in rows if r["result"] not in ("ok", "skipped")]
    for name in failed:
        tail = (OUT / "logs" / f"{name}.log").read_text().splitlines()[-15:]
        print(f"\n--- {name}: {OUT / 'logs' / f'{name}.log'} (last lines)\n" + "\n".join(tail))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
