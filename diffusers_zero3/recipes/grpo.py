"""Online RL for flow-matching pipelines under DeepSpeed ZeRO-3 (Flow-GRPO and DiffusionNFT): the
trainer behind ``scripts/train_grpo.py``.

A round: every rank takes its share of ``--prompts_per_round x --group_size`` (prompt, member)
samples (``rl.group_assignment``; a prompt's members may sit on several ranks), pads it to
``rl.samples_per_rank`` with dummy samples, samples with Flow-GRPO's SDE (or CPS, ``--sampler``;
inside an SDE window only, ``--sde_window_size``; from each group's shared noise with
``--same_noise_per_group``) from the current policy (DiffusionNFT: its old policy)
(no gradient; latents, log-probabilities and sigmas of every step kept), decodes with the VAE,
scores with the rewards (``rewards.load_rewards``: built-in models sharded and called on every
rank, ``module:function`` rewards run on each rank's own images), drops the dummies and
normalises each reward within its prompt's group over every rank's samples
(``rl.gather_group_advantages``). Then the denoiser (a ZeRO-3 engine; LoRA adapters on it with
``--rank``) is trained on the round:

* ``--objective grpo``: for each inner epoch and each trained timestep (each sample's own:
  ``--timestep_subset``; the window's with ``--sde_window_size``), the policy's
  log-probability of the stored next latents, PPO's clipped surrogate (``rl.grpo_loss``) and,
  with ``--kl_beta``, the KL of the SDE step to the reference's (``rl.sde_kl``).
* ``--objective nft``: DiffusionNFT (``rl.nft_loss``) at the sampled clean latents, noised afresh
  at the trained timesteps' sigmas (noise seeded per (round, prompt, member, timestep), as the
  sampling noise is per (round, prompt, member): no rank's RNG); ``v_old`` is the policy of the sampling, evaluated at those
  points before the round's first update.

A micro-batch's trained timesteps are one backward each and one optimizer step together (their
gradients averaged, as Flow-GRPO accumulates; ``--step_every_timestep``: a step each). What
differs between families is the family's (``families.base.Family``, its sampling section): the
denoiser latents' shape (Qwen-Image's one-frame 5-D latents, Flux.2's patchified ones), the
sampling schedule (``sampling_schedule``: the pipeline's sigmas and ``mu``, e.g. Flux.2's
``compute_empirical_mu``), the decode (``decode_images``: the latent normalisation undone as
the pipeline does, Flux.2's batch-norm statistics and unpatchify, Qwen-Image's per-channel mean
and std and one frame) and CFG (Qwen-Image's true CFG rescales to the prompt's norm); a
guidance-distilled transformer (Flux.1 [dev], Flux.2 [dev]) takes ``--guidance_scale`` as its
guidance input instead of CFG, and a step-distilled Flux.2 [klein] runs neither.
With ``--context_parallel_size K`` (``runtime.context_parallel``: a denoiser with a ``_cp_plan``,
Flux.1, Flux.2, Qwen-Image) the ranks form groups of K that draw the same share of the round (the
same prompts and per-sample noise), each rank computing 1/K of every denoiser sequence (the policy's
and a frozen reference's); the decode and the rewards run on every rank of a group on the same
images, so the advantage gather sees each sample K times, which leaves its group's mean and
(population) standard deviation as they are; the loss is multiplied by K before the backward, so
that training equals data parallelism over the N / K groups (tests/test_train_grpo.py: K=2 on 2
ranks against 1 process).
Rank 0's wall-clock seconds of each phase of a round (sampling with the VAE decode, rewards
with the advantage gather, training) go to ``rewards.json`` under ``"seconds"``. Dummy samples
go through every forward (a sharded model's forward is a collective: every rank must call it as
often as the others) and carry no weight in the loss. The reference is the base with the adapters disabled
under LoRA, else a frozen copy placed with ``--reference_placement``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..args import (
    ENGINE_PLACEMENT_CHOICES,
    ArgumentError,
    CommonSettings,
    check_positive,
    component_placements,
    flag,
    placement_flag,
    redefault,
    validate_common_args,
    validate_launch,
)
from ..families import detect_family
from ..placement.frozen import load_frozen_component
from ..placement.frozen_inputs import conditioning_on, place_frozen_models
from ..rewards import ClipScoring, load_rewards, parse_reward_specs
from ..rewards.groupwise import SampleGroups
from ..rl import (
    NftSettings,
    gather_group_advantages,
    gather_group_reward_stats,
    group_assignment,
    grpo_loss,
    guard_log_ratio,
    kept_sample_weight,
    nft_loss,
    nft_old_decay,
    reference_ema_decay,
    reference_ema_updates,
    samples_per_rank,
    sde_kl,
    sde_step_with_logprob,
    sde_window,
    trained_timestep_indices,
)
from ..runtime.context_parallel import (
    ContextParallel,
    context_parallel_of_flags,
    enable_context_parallel,
    set_attention_backend,
)
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import weight_dtype
from ..runtime.host_transfer import host_to_device
from ..runtime.memory import return_large_frees_to_os
from ..runtime.notices import quiet_library_notices
from ..state.ema import ShardedEMA
from ..state.pipeline_io import (
    CurveAxes,
    check_output_dir,
    image_grid,
    model_card,
    pipeline_components,
    plot_curve,
    save_final_pipeline,
)
from ..state.pretrained import resolve_model_folder
from ..state.resume import resume_training, save_training_checkpoint
from ..training.faults import NonFiniteUpdates, StopSignals, parse_signals
from ..training.job import (
    GRAD_ACC_ENV,
    clear_interrupted_writes,
    finish_trackers,
    load_trainable_denoiser,
    setup_accelerator,
)
from ..training.lora import LORA_WEIGHT_NAME, add_lora_adapters, save_lora_zero3
from ..training.parts import (
    TrainedModel,
    adamw,
    prepare_extra_part,
    prepare_first_part,
    set_micro_batch_size,
    step_part,
)
from ..training.report import StepOutput, log_outputs, run_logs
from ..training.schedule import first_last_means
from .text_to_image_settings import TextToImageSettings

OBJECTIVES = ("grpo", "nft")
# tested end to end (tests/test_train_grpo.py); HiDream, Wan (video) and the others are not
# tried yet: refused in one line rather than trained wrong
GRPO_FAMILIES = ("sd3", "flux", "zimage", "qwenimage", "flux2", "flux2-klein", "wan", "wan22_5b", "wan22")
DEFAULT_NUM_FRAMES = 5  # a sampled clip's frames when --num_frames is not given (a video family)
PHASES = ("sampling", "rewards", "training")  # rewards.json "seconds": one list per phase
# rewards.json "stats": one list per statistic: the reward's spread (rl.group_reward_stats), then
# the loss's statistics as flow_grpo / DiffusionNFT log them (means over the round's real samples)
REWARD_STATS = ("reward_std", "zero_std_fraction")
LOSS_STATS = {"grpo": ("clipfrac", "approx_kl", "kl_loss"), "nft": ("kl_loss", "old_deviate")}
_C = CommonSettings


@dataclasses.dataclass
class GRPOSettings(CommonSettings):
    """The settings of ``scripts/train_grpo.py`` (Flow-GRPO / DiffusionNFT)."""

    DESCRIPTION: ClassVar[str] = (
        "Online RL (Flow-GRPO, DiffusionNFT) of a flow-matching pipeline's denoiser under DeepSpeed ZeRO-3, "
        "with reward models sharded and called on every rank."
    )
    GROUP: ClassVar[str | None] = "online RL (Flow-GRPO / DiffusionNFT)"
    gradient_accumulation_steps: int = flag(
        1,
        "Micro-batches per optimizer step (flow_grpo's train.gradient_accumulation_steps): one step per N "
        "micro-batches x trained timesteps (x 1 with --step_every_timestep). N must divide the micro-batches "
        "of a rank's round.",
    )
    tracker_project_name: str = redefault(_C, "tracker_project_name", "grpo")
    output_dir: str = redefault(_C, "output_dir", "grpo-finetuned")
    seed: int = redefault(_C, "seed", 0)
    train_batch_size: int = redefault(_C, "train_batch_size", 4)
    max_train_steps: int = redefault(_C, "max_train_steps", 20)
    learning_rate: float = redefault(_C, "learning_rate", 3e-4)  # the references' train.learning_rate
    adam_weight_decay: float = redefault(_C, "adam_weight_decay", 1e-4)  # their train.adam_weight_decay
    # --- placements of the frozen models (None: replicate)
    text_encoder_placement: str | None = placement_flag(
        None, "Where text_encoder lives.", ENGINE_PLACEMENT_CHOICES
    )
    text_encoder_2_placement: str | None = placement_flag(
        None, "Where text_encoder_2 lives.", ENGINE_PLACEMENT_CHOICES
    )
    text_encoder_3_placement: str | None = placement_flag(
        None, "Where text_encoder_3 lives.", ENGINE_PLACEMENT_CHOICES
    )
    text_encoder_4_placement: str | None = placement_flag(
        None, "Where text_encoder_4 lives.", ENGINE_PLACEMENT_CHOICES
    )
    vae_placement: str | None = placement_flag(None, "Where the VAE lives.", ENGINE_PLACEMENT_CHOICES)
    reference_placement: str = placement_flag(
        "shard",
        "Where the frozen reference denoiser of full fine-tuning lives (LoRA: the base with adapters disabled).",
        ENGINE_PLACEMENT_CHOICES,
    )
    # --- the objective
    objective: str = flag("grpo", "grpo: Flow-GRPO; nft: DiffusionNFT.", choices=OBJECTIVES)
    prompts: list[str] | None = flag(None, "Prompts to sample from.")
    prompt_file: str | None = flag(
        None,
        "A text file of prompts, one a line, or a .jsonl file of rows with a 'prompt' (the row is the prompt's "
        "metadata, given to a reward function that takes a third argument), instead of --prompts.",
    )
    group_size: int = flag(4, "Images per prompt in a round (a group; its members may sit on several ranks).")
    prompts_per_round: int | None = flag(None, "Prompts (groups) per round (default: every prompt).")
    sample_batch_size: int = flag(4, "Samples per denoiser / VAE / reward call while sampling.")
    num_inference_steps: int = flag(10, "SDE steps of each sample.")
    num_frames: int | None = flag(
        None, "Frames of each sampled clip, a video family's (1 + 4k for Wan; default 5).", group="video"
    )
    reward_frames: int = flag(
        8,
        "An image reward scores a clip through this many of its frames, evenly spaced from the first to the last "
        "(0: every frame), the clip's reward their mean; a video judge sees the whole clip.",
        group="video",
    )
    fps: float = flag(16.0, "Frame rate of the sampled clips (Wan's 16): a judge of whole clips samples its frames by time.",
                      group="video")  # fmt: skip
    noise_level: float = flag(0.7, "Flow-GRPO's SDE noise level a.")
    sampler: str = flag(
        "sde",
        "The stochastic step of a round's sampling: sde (Flow-GRPO's) or cps (coefficients-preserving, "
        "arXiv 2509.05952, flow_grpo's sde_type cps; noise std sigma_next x sin(noise_level x pi / 2)).",
        choices=("sde", "cps"),
    )
    sde_window_size: int = flag(
        0,
        "Steps of a round's SDE window (flow_grpo's sde_window_size; 0: every step): the other steps are "
        "deterministic (Euler) and untrained; the window's steps are the trained ones (grpo).",
    )
    sde_window_range: list[int] | None = flag(
        None, "LOW HIGH: the window lies in steps [LOW, HIGH) (flow_grpo's sde_window_range; default: all).",
        metavar="STEP",
    )  # fmt: skip
    ratio_norm: bool = flag(
        False,
        "GRPO-Guard's ratio (arXiv 2510.22319): each step's log policy ratio re-centred to mean 0 and weighted by "
        "the step's noise std (grpo, --sampler sde).",
    )
    same_noise_per_group: bool = flag(
        False,
        "The members of a prompt's group start from the same noise (DanceGRPO; with a window: branching at it).",
    )
    guidance_scale: float = flag(1.0, "Classifier-free guidance scale while sampling (1: none).")
    train_guidance_scale: float | None = flag(
        None,
        "Classifier-free guidance scale of the training forwards (default: --guidance_scale); the unconditional "
        "branch is detached there, as flow_grpo's compute_log_prob.",
    )
    clip_range: float = flag(1e-4, "PPO's clip range of the policy ratio (grpo).")
    adv_clip_max: float = flag(5.0, "Advantages are clamped to [-adv_clip_max, adv_clip_max].")
    timestep_fraction: float = flag(1.0, "Train on this fraction of each sample's sampled timesteps.")
    timestep_subset: str | None = flag(
        None,
        "Which of a sample's timesteps it trains on: first (the noisiest int(T x fraction), flow_grpo) or random "
        "(a random subset per sample and inner epoch, DiffusionNFT). Default: the objective's reference.",
        choices=("first", "random"),
    )
    global_std: bool = flag(
        True,
        "Divide the advantages by the standard deviation of every reward of the round (each group keeping its "
        "mean), as the references' sample.global_std (on in their configs); false: each group's own.",
        as_value=True,
    )
    filter_zero_std: bool = flag(
        True,
        "Leave the samples of zero advantage (a group whose rewards are all equal) out of the loss, the mean "
        "taken over the others, as flow_grpo's train_sd3.py.",
        as_value=True,
    )
    num_inner_epochs: int = flag(1, "Passes over one round's samples.")
    kl_beta: float = flag(0.0, "Weight of the KL to the reference policy.")
    nft_beta: float = flag(1.0, "DiffusionNFT's beta (nft).")
    nft_adv_mode: str = flag(
        "all", "DiffusionNFT's train.adv_mode: which advantages enter r (nft).",
        choices=("all", "positive_only", "negative_only", "one_only", "binary"),
    )  # fmt: skip
    nft_decay_type: int = flag(
        1,
        "DiffusionNFT's decay_type of the old policy that samples and gives v_old: after each round old = d * old + "
        "(1 - d) * trained, d = 0 (type 0: the trained one), min(0.001 x steps, 0.5) (type 1, its default), 0 for "
        "75 steps then min(0.0075 x (steps - 75), 0.999) (type 2) (nft).",
        choices=(0, 1, 2),
    )
    ema_decay: float = flag(
        0.9, "--use_ema's decay, capped by (1 + step) / (10 + step) as the references' EMA."
    )
    ema_update_every: int | None = flag(
        None,
        "--use_ema updates every N optimizer steps (default: flow_grpo's 8 for grpo, DiffusionNFT's 1 for nft).",
    )
    step_every_timestep: bool = flag(
        False,
        "One optimizer step per trained timestep of a micro-batch. Default: as Flow-GRPO, the gradients of a "
        "micro-batch's trained timesteps are averaged and stepped once.",
    )
    max_sequence_length: int | None = flag(None, "T5 tokens per prompt (default: the family's).")
    vlm_question: str | None = flag(
        None,
        "The question the vlm reward's judge answers Yes or No, {prompt} standing for the image's prompt "
        "(default: whether the image matches the prompt).",
    )
    # --- rewards
    reward: list[str] = flag([], "SPEC or SPEC=WEIGHT: a built-in name or module:function; repeatable.",
                             append=True, metavar="SPEC[=WEIGHT]")  # fmt: skip
    reward_model: list[str] = flag([], "NAME=PATH_OR_HUB_ID of a built-in reward.", append=True)
    reward_placement: list[str] = flag([], "NAME=shard|replicate|offload of a built-in reward.", append=True)
    reward_micro_batch_size: int = flag(8, "Samples per reward-model forward.")
    # --- evaluation: held-out prompts sampled deterministically (ODE) with fixed seeds
    eval_prompt_file: str | None = flag(
        None, "Held-out prompts to evaluate on (a text file, or .jsonl rows with a 'prompt' and metadata)."
    )
    eval_steps: int | None = flag(
        None, "Evaluate before the first round and every N rounds (default: --checkpointing_steps)."
    )
    eval_num_inference_steps: int | None = flag(
        None, "Euler (ODE) steps of an evaluation sample (default: 40)."
    )
    eval_resolution: int | None = flag(None, "Evaluation images' side (default: --resolution).")
    eval_reward: list[str] = flag([], "SPEC[=WEIGHT]: a reward measured at evaluation only (repeatable); "
                                  "every --reward is measured too.", append=True, metavar="SPEC")  # fmt: skip
    sample_grid_steps: int | None = flag(
        None,
        "Every N rounds, save rank 0's samples of the round with their rewards as "
        "OUTPUT_DIR/samples/round-N.png and .json (default: at every checkpoint).",
    )
    # --- context parallelism: a group of K ranks samples and trains the same samples
    context_parallel_size: int = redefault(TextToImageSettings, "context_parallel_size", 1)
    context_parallel_mode: str = redefault(TextToImageSettings, "context_parallel_mode", "ulysses")
    attention_backend: str | None = redefault(TextToImageSettings, "attention_backend", None)
    gradient_checkpointing: bool = flag(
        False,
        "Recompute the trained denoisers' blocks in the backward: less activation memory, more compute.",
    )
    # --- LoRA
    rank: int | None = flag(None, "Train LoRA adapters of this rank (None: full fine-tuning).")
    lora_alpha: float | None = flag(None, "LoRA alpha (default: the rank).")
    lora_layers: str | None = flag(None, "Comma-separated modules to adapt (default: the family's).")

    def resolve(self) -> None:
        """Read ``--prompt_file``, fill ``--prompts_per_round`` and check the combinations (one
        ``ArgumentError`` line each)."""
        if self.prompts and self.prompt_file:
            raise ArgumentError("give --prompts or --prompt_file, not both")
        if self.prompt_file:
            self.prompts, _ = read_prompt_file(self.prompt_file, "--prompt_file")
        if not self.prompts:
            raise ArgumentError("no prompts: give --prompts or a non-empty --prompt_file")
        if not self.reward:
            raise ArgumentError("no reward: give --reward SPEC[=WEIGHT] at least once")
        for name in ("group_size", "num_inference_steps", "num_inner_epochs", "sample_batch_size",
                     "train_batch_size", "max_train_steps", "reward_micro_batch_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ArgumentError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.eval_prompt_file is not None:
            read_prompt_file(self.eval_prompt_file, "--eval_prompt_file")  # its errors, early
            self.eval_steps = self.eval_steps or self.checkpointing_steps
            self.eval_num_inference_steps = self.eval_num_inference_steps or 40
            self.eval_resolution = self.eval_resolution or self.resolution
            for name in ("eval_steps", "eval_num_inference_steps", "eval_resolution"):
                if getattr(self, name) < 1:
                    raise ArgumentError(f"--{name} must be at least 1, got {getattr(self, name)}")
        elif self.eval_reward or self.eval_steps:
            raise ArgumentError("--eval_reward and --eval_steps need --eval_prompt_file")
        if self.sample_grid_steps is not None and self.sample_grid_steps < 1:
            raise ArgumentError(f"--sample_grid_steps must be at least 1, got {self.sample_grid_steps}")
        if self.prompts_per_round is None:
            self.prompts_per_round = len(self.prompts)
        if not 1 <= self.prompts_per_round <= len(self.prompts):
            raise ArgumentError(
                f"--prompts_per_round must be between 1 and the {len(self.prompts)} prompts, got {self.prompts_per_round}"
            )
        if self.group_size < 2:
            raise ArgumentError("--group_size must be at least 2: advantages compare the members of a group")
        if not 0 < self.timestep_fraction <= 1:
            raise ArgumentError(f"--timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.objective == "grpo" and self.noise_level <= 0:
            raise ArgumentError("--objective grpo needs --noise_level > 0 (the SDE step's log-probability)")
        if self.clip_range <= 0 or self.adv_clip_max <= 0:
            raise ArgumentError("--clip_range and --adv_clip_max must be positive")
        if self.fps <= 0:
            raise ArgumentError(f"--fps must be positive, got {self.fps}")
        if self.reward_frames < 0:
            raise ArgumentError(
                f"--reward_frames {self.reward_frames}: give a count of frames, or 0 for every frame"
            )
        if self.kl_beta < 0:
            raise ArgumentError(f"--kl_beta must be >= 0, got {self.kl_beta}")
        if self.objective == "nft" and self.nft_beta <= 0:
            raise ArgumentError(f"--nft_beta must be positive, got {self.nft_beta}")
        if self.guidance_scale < 1:
            raise ArgumentError(f"--guidance_scale must be >= 1 (1: no guidance), got {self.guidance_scale}")
        if self.sde_window_range is not None and len(self.sde_window_range) != 2:
            raise ArgumentError(f"--sde_window_range takes two steps, LOW HIGH; got {self.sde_window_range}")
        if self.sde_window_size:
            low, high = self.sde_window_range or (0, self.num_inference_steps)
            if self.objective != "grpo":
                raise ArgumentError("--sde_window_size applies to --objective grpo (its log-probabilities)")
            if not (0 <= low < high <= self.num_inference_steps and 1 <= self.sde_window_size <= high - low):
                raise ArgumentError(
                    f"--sde_window_size {self.sde_window_size} must fit in --sde_window_range {low} {high} within the "
                    f"{self.num_inference_steps} steps"
                )
            self.sde_window_range = [low, high]
        elif self.sde_window_range is not None:
            raise ArgumentError("--sde_window_range needs --sde_window_size")
        if (
            self.sampler == "cps"
            and self.sde_window_size
            and self.sde_window_range[1] == self.num_inference_steps
        ):
            raise ArgumentError(
                "--sampler cps adds no noise at the last step (its std is sigma_next x ...): give an "
                f"--sde_window_range that ends before step {self.num_inference_steps}"
            )
        if self.sampler == "cps" and self.kl_beta > 0 and not self.sde_window_size:
            raise ArgumentError(
                "--sampler cps with --kl_beta needs an --sde_window_size window before the last step (the KL divides "
                "by the step's noise, none at the last step)"
            )
        if self.ratio_norm and (self.objective != "grpo" or self.sampler != "sde"):
            raise ArgumentError("--ratio_norm applies to --objective grpo with --sampler sde")
        if self.train_guidance_scale is None:
            self.train_guidance_scale = self.guidance_scale
        if self.train_guidance_scale < 1:
            raise ArgumentError(
                f"--train_guidance_scale must be >= 1 (1: no guidance), got {self.train_guidance_scale}"
            )
        if (
            self.timestep_subset is None
        ):  # the objective's reference: flow_grpo trains in order, NFT at random
            self.timestep_subset = "first" if self.objective == "grpo" else "random"
        if self.ema_update_every is None:  # flow_grpo's EMA every 8 steps, DiffusionNFT's every step
            self.ema_update_every = 8 if self.objective == "grpo" else 1
        if self.ema_update_every < 1 or self.gradient_accumulation_steps < 1:
            raise ArgumentError("--ema_update_every and --gradient_accumulation_steps must be at least 1")
        if not 0 <= self.ema_decay < 1:
            raise ArgumentError(f"--ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.rank is not None and self.rank < 1:
            raise ArgumentError(f"--rank must be at least 1 (omit it for full fine-tuning), got {self.rank}")
        if self.rank is not None and self.reference_placement != "shard":
            raise ArgumentError(
                f"--reference_placement {self.reference_placement} applies to full fine-tuning: with LoRA "
                f"(--rank {self.rank}) the reference is the base with the adapters disabled"
            )
        self.reward_specs  # noqa: B018  parsed once, here: their errors early

    @functools.cached_property
    def reward_specs(self) -> tuple[list, list]:
        """``(--reward specs, --eval_reward specs)`` (``rewards.RewardSpec``), parsed together so
        that ``--reward_model`` / ``--reward_placement`` may name either; one ``ArgumentError``
        line for a bad one. Parsed once (by ``resolve``)."""
        specs = parse_reward_specs(
            [*self.reward, *self.eval_reward], self.reward_model, self.reward_placement
        )
        return specs[: len(self.reward)], specs[len(self.reward) :]

    @property
    def train_timesteps(self) -> int:
        """How many of a sample's steps are trained (at least one): of the SDE window's, or of all."""
        return max(1, int((self.sde_window_size or self.num_inference_steps) * self.timestep_fraction))

    @property
    def accumulation_steps(self) -> int:
        """Backwards per optimizer step: ``--gradient_accumulation_steps`` micro-batches times their
        trained timesteps (Flow-GRPO's and DiffusionNFT's ``gradient_accumulation_steps *
        num_train_timesteps``), or ``--gradient_accumulation_steps`` with ``--step_every_timestep``."""
        per_batch = 1 if self.step_every_timestep else self.train_timesteps
        return self.gradient_accumulation_steps * per_batch


def read_prompt_file(path: str, flag_name: str) -> tuple[list[str], list[dict]]:
    """The prompts of a prompt file and each one's metadata: a text file (one prompt a line, no
    metadata: ``{}``), or a ``.jsonl`` file whose rows are objects with a ``"prompt"`` (the whole
    row is the metadata, as GenEval's ``*_metadata.jsonl``). One ``ArgumentError`` line naming
    the file (and row) for a missing file, a bad row or no prompt. Not a collective.

    Example:
        >>> read_prompt_file("geneval.jsonl", "--eval_prompt_file")  # doctest: +SKIP
        (['a photo of a red bench'], [{'prompt': 'a photo of a red bench', 'tag': 'colors', ...}])
    """
    file = Path(path)
    if not file.is_file():
        raise ArgumentError(f"{flag_name} {path}: no such file")
    lines = [line.strip() for line in file.read_text().splitlines() if line.strip()]
    if file.suffix != ".jsonl":
        prompts, metadata = lines, [{} for _ in lines]
    else:
        prompts, metadata = [], []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ArgumentError(f"{flag_name} {path}: row {number} is not JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ArgumentError(
                    f"{flag_name} {path}: row {number} is not an object with a 'prompt' string"
                )
            prompts.append(row["prompt"])
            metadata.append(row)
    if not prompts:
        raise ArgumentError(f"{flag_name} {path}: no prompts in it")
    return prompts, metadata


@dataclasses.dataclass
class Conditioning:
    """The text conditioning of a batch of samples (the family's), and the empty prompts' for CFG
    (None without CFG): what ``GRPOTrainer._velocity`` reads of a ``Round``."""

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None


@dataclasses.dataclass
class Round:
    """One round of this rank's samples, padded to ``samples_per_rank``: ``real`` marks the
    samples that are not dummies. ``latents[:, i]`` is the state before step ``i`` (the last
    one the clean latents), ``log_probs[:, i]`` the sampling policy's log-probability of step
    ``i``; ``sigmas`` ``[T + 1]`` the schedule; ``images`` the decoded clean latents in [0, 1] of
    the samples this rank scores (``scored``: every one, or under context parallelism its share
    of its group's) until the round is scored. All on the accelerator's device."""

    index: int  # the round's number (0-based): seeds its noise with the (prompt, member) pairs
    pairs: list[tuple[int, int]]
    real: torch.Tensor  # [P] bool
    prompts: list[str]
    metadata: list[dict]  # each sample's prompt's metadata (a .jsonl prompt file's row, else {})
    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None
    latents: torch.Tensor  # [P, T + 1, *family.denoiser_latent_shape]: [C, H, W], Qwen-Image [C, 1, H, W]
    log_probs: torch.Tensor  # [P, T]
    sigmas: torch.Tensor  # [T + 1]
    images: torch.Tensor | None = (
        None  # [S, 3, H, W] (clips [S, F, 3, H, W]) of `scored`, dropped once scored
    )
    scored: list[int] = dataclasses.field(default_factory=list)  # the S rows this rank decodes and scores
    window: tuple[int, int] | None = None  # the round's SDE window [start, end) (--sde_window_size)
    means: torch.Tensor | None = (
        None  # [P, T, ...]: each step's mean under the sampling policy (--ratio_norm)
    )
    advantages: torch.Tensor | None = None  # [P], 0 for dummies
    weight: torch.Tensor | None = None  # [P] each sample's weight in the loss (rl.kept_sample_weight)
    steps: torch.Tensor | None = None  # [E, P, K] long: each inner epoch's trained steps of each sample
    # per inner epoch, per trained slot k: (x_t [P, ...], v_old [P, ...], sigma [P]) (nft)
    nft_points: list | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # REWARD_/LOSS_STATS, every rank's


def pad_assignment(pairs: list[tuple[int, int]], length: int) -> tuple[list[tuple[int, int]], list[bool]]:
    """This rank's ``pairs`` padded to ``length`` with dummies (copies of its last pair, or of
    ``(0, 0)`` for a rank with none) and which entries are real.

    Example:
        >>> pad_assignment([(2, 1)], 3)
        ([(2, 1), (2, 1), (2, 1)], [True, False, False])
    """
    filler = pairs[-1] if pairs else (0, 0)
    return pairs + [filler] * (length - len(pairs)), [True] * len(pairs) + [False] * (length - len(pairs))


def _hashed_generator(key: str) -> torch.Generator:
    """A CPU generator seeded by the SHA-256 of ``key`` (drawn on the CPU and moved: the same
    numbers on every device)."""
    digest = hashlib.sha256(key.encode()).digest()
    g = torch.Generator()  # CPU: drawn there and moved, the same on every device
    g.manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample_generator(seed: int, round_index: int, prompt: int, member: int) -> torch.Generator:
    """The CPU generator of one sample's noise: the same whichever rank (and however many ranks)
    draws it, so that a resumed run or another world size samples the same images."""
    return _hashed_generator(f"grpo:{seed}:{round_index}:{prompt}:{member}")


def group_noise_generator(seed: int, round_index: int, prompt: int) -> torch.Generator:
    """The CPU generator of a group's shared initial noise (``--same_noise_per_group``): every
    member of the prompt's group, on any rank, starts from its first draw."""
    return _hashed_generator(f"grpo-group:{seed}:{round_index}:{prompt}")


def round_window(seed: int, round_index: int, size: int, window_range: tuple[int, int]) -> tuple[int, int]:
    """The round's SDE window (``rl.sde_window`` with a generator of ``(seed, round)``): the same on
    every rank and any number of ranks, and on resume."""
    digest = hashlib.sha256(f"grpo-window:{seed}:{round_index}".encode()).digest()
    return sde_window(size, window_range, random.Random(int.from_bytes(digest[:8], "little")))


def nft_noise_generator(
    seed: int, round_index: int, prompt: int, member: int, timestep: int, inner_epoch: int = 0
) -> torch.Generator:
    """The CPU generator of DiffusionNFT's fresh noise of one sample at one trained timestep
    (its index in the schedule) in one inner epoch: like ``sample_generator``, independent of
    the rank and of the number of ranks, and of the sampling noise."""
    epoch = f":{inner_epoch}" if inner_epoch else ""  # the first epoch's keys as before epochs had one
    return _hashed_generator(f"grpo-nft:{seed}:{round_index}:{prompt}:{member}:{timestep}{epoch}")


def timestep_generator(
    seed: int, round_index: int, prompt: int, member: int, inner_epoch: int
) -> torch.Generator:
    """The CPU generator of the random subset of one sample's timesteps it trains on in one inner
    epoch (``--timestep_subset random``): independent of the rank and of the number of ranks."""
    return _hashed_generator(f"grpo-steps:{seed}:{round_index}:{prompt}:{member}:{inner_epoch}")


def pipeline_sigmas(pipeline_class: str, steps: int) -> list[float] | None:
    """The sigmas a pipeline's ``__call__`` gives ``set_timesteps`` by default (its family's
    ``sampling_sigmas``): ``FluxPipeline``'s ``numpy.linspace(1, 1 / steps, steps)``,
    ``ZImagePipeline``'s the same from ``torch.linspace`` (fp32); None where the scheduler spaces
    them itself (``StableDiffusion3Pipeline``)."""
    from ..families import FAMILIES

    return FAMILIES[pipeline_class].sampling_sigmas(steps)


def set_sampling_timesteps(
    scheduler, steps: int, image_seq_len: int, device: torch.device, *, sigmas: list[float] | None = None,
    mu: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Set ``scheduler``'s (``FlowMatchEulerDiscreteScheduler``) timesteps as the pipelines do and
    return its sigmas ``[steps + 1]`` (the last 0) on ``device`` in fp32: from ``sigmas``
    (``pipeline_sigmas``) or the scheduler's own spacing, shifted by the config's ``shift`` or,
    under ``use_dynamic_shifting``, by ``mu`` (a family's ``sampling_mu``; by default
    ``calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift,
    max_shift)`` of the scheduler's config, as ``FluxPipeline`` computes it; ``image_seq_len``:
    the denoiser's tokens per image). Not a collective."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = scheduler.config
    kwargs: dict[str, Any] = {} if sigmas is None else {"sigmas": sigmas}
    if mu is not None:
        kwargs["mu"] = mu
    elif config.get("use_dynamic_shifting"):
        kwargs["mu"] = calculate_shift(
            image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )  # fmt: skip
    scheduler.set_timesteps(steps, device=device, **kwargs)
    return scheduler.sigmas.to(device=device, dtype=torch.float32)


def sampling_schedule(
    family, scheduler, steps: int, latent_shape: tuple[int, ...], vae_config: dict, denoiser_config: dict,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """The sampling schedule ``[steps + 1]`` (ending at 0, fp32, on ``device``) of ``family``'s
    pipeline for denoiser latents of ``latent_shape`` (``family.denoiser_latent_shape``): its
    ``sampling_sigmas`` and its ``sampling_mu`` of the image's tokens (``family.image_seq_len``),
    set on ``scheduler``. Not a collective."""
    seq_len = family.image_seq_len(latent_shape, vae_config, denoiser_config)
    return set_sampling_timesteps(
        scheduler, steps, seq_len, device, sigmas=family.sampling_sigmas(steps),
        mu=family.sampling_mu(scheduler.config, seq_len, steps),
    )  # fmt: skip


def decode_images(family, vae, normalize, latents: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` (a video family: clips ``[N, F, 3, H, W]``) in [0, 1] (fp32) of
    denoiser latents, as ``family``'s pipeline decodes them with ``output_type="pt"``:
    ``family.decode_latents`` (``normalize``, the family's ``latent_normalizer``, undone; the
    VAE's decode), then ``x / 2 + 0.5`` clamped. Collective when the VAE is sharded."""
    images = (family.decode_latents(vae, normalize, latents).float() / 2 + 0.5).clamp(0, 1)
    # the video VAE decodes [N, 3, F, H, W]; the pipelines' postprocess_video gives [N, F, 3, H, W]
    return images.transpose(1, 2) if family.video else images


def clip_frames(family, vae_config: dict, num_frames: int | None) -> int:
    """The frames of a sampled clip: ``num_frames`` (``--num_frames``, default
    ``DEFAULT_NUM_FRAMES``) for a video family, checked to be ``1 + k * frame_multiple`` (what
    its VAE decodes whole); 1 for an image family, which refuses ``--num_frames`` above 1. One
    ``ArgumentError`` line. Not a collective."""
    if not family.video:
        if num_frames not in (None, 1):
            raise ArgumentError(f"--num_frames {num_frames}: the {family.title} pipeline makes images")
        return 1
    frames = DEFAULT_NUM_FRAMES if num_frames is None else num_frames
    multiple = family.frame_multiple(vae_config)
    if frames < 1 or (frames - 1) % multiple:
        raise ArgumentError(
            f"--num_frames {frames}: {family.title} clips are 1 + {multiple}k frames (1, {1 + multiple}, {1 + 2 * multiple}, ...)"
        )
    return frames


def wall_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (CUDA runs kernels
    asynchronously: without the wait, a phase's kernels would count in the next one). Not a
    collective."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cat_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` and ``b`` stacked along the batch, the shorter zero-padded along dimension 1 first:
    families that trim the text states and their mask to a batch's longest caption (Z-Image,
    Qwen-Image) encode the empty prompts of CFG shorter than the prompts; a zero mask row is
    ignored.

    Example:
        >>> cat_padded(torch.ones(1, 2), torch.ones(1, 3)).tolist()
        [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    """
    if a.ndim >= 2 and a.shape[1] != b.shape[1]:
        length = max(a.shape[1], b.shape[1])

        def pad(x: torch.Tensor) -> torch.Tensor:
            rest = [0, 0] * (x.ndim - 2)
            return torch.nn.functional.pad(x, [*rest, 0, length - x.shape[1]])

        a, b = pad(a), pad(b)
    return torch.cat([a, b])


def save_sample_grid(
    folder: Path, round_number: int, images: torch.Tensor, prompts: list[str], rewards: list[float],
    stem: str = "round",
) -> Path:  # fmt: skip
    """Save a round's samples (``[n, 3, H, W]`` in ``[0, 1]``; clips ``[n, F, 3, H, W]``) as one
    grid ``folder/<stem>-N.png`` (4 images per row; a clip's frames in a row, one clip a row) and
    ``folder/<stem>-N.json`` (each sample's prompt and weighted reward, in the grid's order);
    each file written whole, then renamed into place. Main process only (no collective);
    returns the PNG's path."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    cols = images.shape[1] if images.ndim == 5 else min(4, len(images))
    frames = images.flatten(0, 1) if images.ndim == 5 else images
    pixels = (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
    grid = image_grid([Image.fromarray(np.ascontiguousarray(x.numpy())) for x in pixels], cols=cols)
    path = folder / f"{stem}-{round_number}.png"
    grid.save(folder / f".{path.name}.partial", format="PNG")
    (folder / f".{path.name}.partial").replace(path)
    meta = folder / f"{stem}-{round_number}.json"
    (folder / f".{meta.name}.partial").write_text(
        json.dumps([{"prompt": q, "reward": r} for q, r in zip(prompts, rewards)], indent=1)
    )
    (folder / f".{meta.name}.partial").replace(meta)
    return path


def share_calls(length: int, size: int, chunk: int) -> int:
    """Calls of ``chunk`` rows that decode (score) the largest share of ``length`` rows dealt
    every ``size``-th to ``size`` ranks: each rank makes that many, whatever its own share."""
    return math.ceil(math.ceil(length / size) / chunk)


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


class GRPOTrainer:
    """setup() -> train() -> save(). Every method is collective: call on every rank."""

    def __init__(self, args: GRPOSettings):
        self.args = args
        self.global_step = 0  # rounds done
        self.rewards: list[float] = []
        self.rewards_by_spec: dict[str, list[float]] = {}
        # rank 0's wall-clock seconds of each phase per round (each rank times its own)
        self.seconds: dict[str, list[float | None]] = {phase: [] for phase in PHASES}
        # per round: REWARD_STATS and LOSS_STATS[objective] (None for rounds of a checkpoint
        # written without them)
        self.stats: dict[str, list[float | None]] = {
            name: [] for name in (*REWARD_STATS, *LOSS_STATS[args.objective])
        }
        self.trained_rounds = 0
        self.optimizer_steps = 0  # optimizer steps taken by this process (not restored on resume)
        self.nonfinite = NonFiniteUpdates(args.max_nonfinite_steps)
        self.stop_signals = StopSignals(parse_signals(args.save_on_signal))
        self.cp: ContextParallel | None = None  # --context_parallel_size > 1
        self.num_frames = 1  # frames of a sampled clip (a video family's --num_frames), set in setup
        self.old_policy: ShardedEMA | None = None  # DiffusionNFT's, --nft_decay_type 1 or 2
        # Wan 2.2 A14B: the low-noise expert's part (the first part is the high-noise one), the
        # timestep where sampling switches to it, and the high expert's chance to be a round's
        self.second: TrainedModel | None = None
        self.second_old_policy: ShardedEMA | None = None
        self.boundary: float | None = None
        self.p_high = 1.0
        # evaluations: the round each ran before (0: before training), the total's mean, each reward's
        self.evaluations: dict[str, list[float]] = {"round": [], "mean": []}

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Load and place every model, prepare the denoiser's engine, resume. Collective."""
        from accelerate.utils import set_seed

        args = self.args
        quiet_library_notices()  # before the first pipeline module is imported
        validate_common_args(args)
        check_positive(args, ("num_inference_steps",))
        if args.return_freed_memory:
            return_large_frees_to_os()
        self.source = resolve_model_folder(args.pretrained_model_name_or_path)
        check_output_dir(args.output_dir, self.source)
        pipeline_components(self.source)
        self.family = family = detect_family(self.source)
        if family.edits:
            raise ArgumentError(
                f"{args.pretrained_model_name_or_path} is a {family.pipeline_class}, which edits a source image;"
                " train_grpo.py samples from prompts alone (edit RL on source images is not built)"
            )
        if family.name not in GRPO_FAMILIES:
            raise ArgumentError(
                f"{args.pretrained_model_name_or_path} is a {family.pipeline_class}; train_grpo.py trains "
                f"the flow-matching families it is tested on: {', '.join(GRPO_FAMILIES)}"
            )
        placements = self._placements()
        # the launch configuration's gradient_accumulation_steps never applies here (it follows
        # --timestep_fraction): dropped, so that no line says a flag overrode it
        os.environ.pop(GRAD_ACC_ENV, None)
        self.accelerator = acc = setup_accelerator(
            args.output_dir, mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.accumulation_steps,
            report_to=args.report_to, logging_dir=args.logging_dir, max_grad_norm=args.max_grad_norm,
            process_group_timeout=args.process_group_timeout, dead_rank_timeout=args.dead_rank_timeout,
        )  # fmt: skip
        checked = {**placements, **({"reference": args.reference_placement} if args.rank is None else {})}
        validate_launch(
            args, deepspeed_active=acc.state.deepspeed_plugin is not None, on_cpu=acc.device.type == "cpu",
            placements=checked,
        )  # fmt: skip
        self.cp = context_parallel_of_flags(args.context_parallel_size, args.context_parallel_mode, acc)
        clear_interrupted_writes(args.output_dir)
        set_seed(args.seed, device_specific=True)  # LoRA's init: the engine broadcasts rank 0's
        self.dtype = weight_dtype(acc)
        self.scheduler = family.load_noise_scheduler(self.source)
        self.tokenizers = family.load_tokenizers(self.source)
        # Wan 2.2 A14B: both experts train, the low-noise one a part of its own
        denoisers = [
            load_trainable_denoiser(acc, self.source, family, folder=Path(self.source) / name)
            for name in family.pipeline_denoisers
        ]
        for denoiser in denoisers:
            if args.rank is not None:
                targets = args.lora_layers.split(",") if args.lora_layers else family.lora_target_modules
                add_lora_adapters(
                    denoiser,
                    rank=args.rank,
                    target_modules=targets,
                    alpha=args.lora_alpha,
                    seed=args.seed or 0,
                )
            if args.attention_backend is not None:
                try:
                    set_attention_backend(denoiser, args.attention_backend)
                except ValueError as e:
                    raise ArgumentError(str(e)) from e
            if self.cp is not None:  # after LoRA's layers, so that the plan's modules are the wrapped ones
                self._split_sequence(denoiser)
            if args.gradient_checkpointing:
                denoiser.enable_gradient_checkpointing()
        denoiser = denoisers[0]
        self.frozen = place_frozen_models(acc, family, self.source, placements)
        self.vae = self.frozen.models["vae"]
        multiple = family.latent_multiple(self.vae.config)
        for name, side in (("resolution", args.resolution), ("eval_resolution", args.eval_resolution)):
            if side is not None and side % multiple:
                raise ArgumentError(f"--{name} {side} must be a multiple of {multiple} for {family.name}")
        self.num_frames = clip_frames(family, self.vae.config, args.num_frames)
        if len(denoisers) > 1:
            self._check_experts(denoiser.config)
        # a guidance-distilled transformer (Flux.1 [dev], Flux.2 [dev]) takes --guidance_scale as an
        # input: no CFG; otherwise CFG where the pipeline runs it (not a step-distilled Flux.2 [klein])
        self.guidance_embeds = bool(denoiser.config.get("guidance_embeds", False))
        model_index = json.loads((Path(self.source) / "model_index.json").read_text())
        # the empty prompts are encoded where sampling or training runs CFG
        self.cfg = family.classifier_free_guidance(
            model_index, denoiser.config, max(args.guidance_scale, args.train_guidance_scale)
        )
        if max(args.guidance_scale, args.train_guidance_scale) > 1 and not (self.cfg or self.guidance_embeds):
            log_rank_zero(
                f"--guidance_scale {args.guidance_scale} ignored: the {family.title} pipeline runs no CFG"
            )
        self.reference, self.references = None, {}
        if args.rank is None and self._needs_reference():
            for name in family.pipeline_denoisers:  # Wan 2.2 A14B: each expert's
                reference = load_frozen_component(
                    acc, self.source, name, args.reference_placement, family.denoiser_cls(),
                    dtype=self.dtype, label="reference" if name == family.denoiser else f"reference {name}",
                )  # fmt: skip
                if args.attention_backend is not None:
                    set_attention_backend(reference.module, args.attention_backend)  # it ran on the policy
                if self.cp is not None:
                    self._split_sequence(reference.module, trained=False)
                log_rank_zero(reference.describe())
                self.references[name] = reference
            self.reference = self.references[family.denoiser]
        specs, eval_specs = args.reward_specs
        self.reward_names = [s.name for s in specs]
        self.groupwise_rewards = [s.name for s in specs if s.is_groupwise]  # scored on a whole round
        if self.groupwise_rewards and family.video:
            raise ArgumentError(
                f"--reward {self.groupwise_rewards[0]}: a group-wise reward judges images, and {family.title} samples clips"
            )
        if self.groupwise_rewards and args.eval_prompt_file:  # evaluation scores one image a prompt
            raise ArgumentError(
                f"--eval_prompt_file: the group-wise rewards {', '.join(self.groupwise_rewards)} score a prompt's"
                " group of samples, and evaluation draws one image a prompt"
            )
        self.reward_fn = load_rewards(
            specs,
            acc,
            self.dtype,
            micro_batch_size=args.reward_micro_batch_size,
            vlm_question=args.vlm_question,
            clips=ClipScoring(args.reward_frames, args.fps),
        )
        set_micro_batch_size(acc, args.train_batch_size)
        self.part, _ = prepare_first_part(
            acc, family.denoiser, denoiser, adamw(denoiser, args), max_grad_norm=args.max_grad_norm,
            ema=bool(args.use_ema),
        )  # fmt: skip
        self.engine, self.ema = self.part.engine, self.part.ema
        if len(denoisers) > 1:
            optimizer = adamw(denoisers[1], args)
            constant = torch.optim.lr_scheduler.ConstantLR(
                optimizer, factor=1.0, total_iters=0
            )  # as the first's
            self.second = prepare_extra_part(
                acc, family.pipeline_denoisers[1], denoisers[1], optimizer, constant,
                first_engine=self.engine if hasattr(self.engine, "save_checkpoint") else None,
                max_grad_norm=args.max_grad_norm,
            )  # fmt: skip
            self.second.ema = ShardedEMA(self.second.engine) if args.use_ema else None
        # DiffusionNFT's old policy: an average of the trained weights, partitioned like them
        if args.objective == "nft" and args.nft_decay_type != 0:
            self.old_policy = ShardedEMA(self.engine)
            self.second_old_policy = ShardedEMA(self.second.engine) if self.second is not None else None
        self._check_accumulation()
        if (
            acc.state.deepspeed_plugin is not None
            and self.engine.gradient_accumulation_steps() != args.accumulation_steps
        ):
            raise RuntimeError(  # DeepSpeed divides each backward's loss by its own count
                f"DeepSpeed accumulates {self.engine.gradient_accumulation_steps()} backwards, not {args.accumulation_steps}"
            )
        log_rank_zero(f"one optimizer step per {args.accumulation_steps} backward(s) of a micro-batch")
        if acc.is_main_process and args.report_to != "none":
            acc.init_trackers(args.tracker_project_name, args.scalars())
        self.rewards_by_spec = {name: [] for name in self.reward_names}
        self.prompt_metadata = (
            read_prompt_file(args.prompt_file, "--prompt_file")[1]
            if args.prompt_file
            else [{} for _ in args.prompts]
        )
        self.eval_prompts, self.eval_metadata, self.eval_reward_fn = [], [], None
        if args.eval_prompt_file:
            self.eval_prompts, self.eval_metadata = read_prompt_file(
                args.eval_prompt_file, "--eval_prompt_file"
            )
            if eval_specs:
                self.eval_reward_fn = load_rewards(
                    eval_specs, acc, self.dtype, micro_batch_size=args.reward_micro_batch_size,
                    vlm_question=args.vlm_question, clips=ClipScoring(args.reward_frames, args.fps),
                )  # fmt: skip
            names = [*self.reward_names, *(s.name for s in eval_specs)]
            self.evaluations.update({name: [] for name in names})
        resumed = resume_training(
            acc, args.output_dir, args.resume_from_checkpoint, ema=self.ema, averages=self._averages(),
            parts=self._second_parts(), fallback=args.resume_fallback,
        )  # fmt: skip
        if resumed is not None:
            path, state = resumed
            self.global_step, self.rewards = state["global_step"], state["rewards"]
            self.rewards_by_spec = state["rewards_by_spec"]
            # a checkpoint written before the timings were kept: None for its rounds
            saved = state.get("seconds") or {}
            self.seconds = {p: list(saved.get(p, [None] * self.global_step)) for p in PHASES}
            saved = state.get("stats") or {}
            self.stats = {k: list(saved.get(k, [None] * self.global_step)) for k in self.stats}
            saved = state.get("evaluations") or {}
            self.evaluations = {k: list(saved.get(k, [])) for k in self.evaluations}
            log_rank_zero(f"resumed from {path} at round {self.global_step}")
            if state["world_size"] != acc.num_processes:  # rounds do not depend on the world size
                log_rank_zero(
                    f"{path} was written by {state['world_size']} processes; resharded for {acc.num_processes}"
                )

    def _averages(self) -> dict[str, ShardedEMA]:
        """The averages a checkpoint holds beside the engines and the EMAs: the old policy (each
        expert's for Wan 2.2 A14B)."""
        averages = {} if self.old_policy is None else {"nft_old_policy": self.old_policy}
        if self.second_old_policy is not None:
            averages[f"nft_old_policy_{self.second.name}"] = self.second_old_policy
        return averages

    def _second_parts(self) -> list[TrainedModel]:
        """The trained parts beside the first (Wan 2.2 A14B's low-noise expert), checkpointed
        with it."""
        return [] if self.second is None else [self.second]

    def _check_experts(self, denoiser_config: dict) -> None:
        """Wan 2.2 A14B: the boundary timestep between the experts, and a round's trained steps
        all of one expert (``round_part``), drawn from its steps: each expert must have at least
        the trained steps of a round (``--timestep_fraction``) among the sampled ones, and no
        sliding window may move them. One ``ArgumentError`` line each. Not a collective."""
        args, family = self.args, self.family
        if args.rank is not None:  # one LoRA file of diffusers' Wan loader holds one expert's adapters
            raise ArgumentError(
                f"--rank: {family.title}'s rounds train both experts; LoRA trains one at a time"
            )
        if args.sde_window_size:
            raise ArgumentError(
                f"--sde_window_size: {family.title}'s rounds train one expert on its own steps, which a sliding"
                " window would move"
            )
        self.boundary = family.boundary(self.source)
        shape = family.sample_latent_shape(self.vae.config, args.resolution, args.resolution, self.num_frames)
        sigmas = sampling_schedule(
            family, self.scheduler, args.num_inference_steps, shape, self.vae.config, denoiser_config,
            torch.device("cpu"),
        )[:-1]  # fmt: skip
        high = int((sigmas * 1000 >= self.boundary).sum())
        low = len(sigmas) - high
        if min(high, low) < args.train_timesteps:
            raise ArgumentError(
                f"--timestep_fraction {args.timestep_fraction} trains {args.train_timesteps} steps of a round's expert,"
                f" and of the {len(sigmas)} sampled steps {high} are the high-noise expert's and {low} the"
                f" low-noise one's (timestep >= {self.boundary:g}): lower it to at most {min(high, low)}/{len(sigmas)}"
            )
        self.p_high = high / len(sigmas)
        log_rank_zero(
            f"experts: each round trains one, the high-noise one with probability {self.p_high:.2f}"
            f" ({high} of {len(sigmas)} sampled steps at timestep >= {self.boundary:g})"
        )

    def round_part(self, round_index: int) -> TrainedModel:
        """The part a round trains: the denoiser, or for Wan 2.2 A14B the expert drawn for the
        round (``wan.expert_of_step`` of the round, the high-noise one with its share of the
        sampled steps): the same on every rank and on a resume. Not a collective."""
        if self.second is None:
            return self.part
        from ..families.wan import HIGH, expert_of_step

        return self.part if expert_of_step(self.args.seed, round_index, self.p_high) == HIGH else self.second

    def _sampling_model(self, sigma: torch.Tensor):
        """The engine that denoises at ``sigma`` (a number): the denoiser, or Wan 2.2 A14B's expert
        of its timestep (``sigma * 1000 >= boundary``: the high-noise one), as the pipeline's
        loop. Not a collective."""
        if self.second is None or float(sigma) * 1000 >= self.boundary:
            return self.engine
        return self.second.engine

    def _check_accumulation(self) -> None:
        """``--gradient_accumulation_steps`` must divide a rank's micro-batches of a round (an
        optimizer step never spans two rounds, whose samples differ); one error line. Not a
        collective."""
        args = self.args
        groups, _ = self.sampling_ranks
        micro_batches = -(
            -samples_per_rank(args.prompts_per_round, args.group_size, groups) // args.train_batch_size
        )
        if micro_batches % args.gradient_accumulation_steps:
            raise ArgumentError(
                f"--gradient_accumulation_steps {args.gradient_accumulation_steps} does not divide the {micro_batches} "
                f"micro-batches of --train_batch_size {args.train_batch_size} in a rank's round"
            )

    def _split_sequence(self, model: torch.nn.Module, trained: bool = True) -> None:
        """Split ``model``'s (the policy's, the frozen reference's) sequence over the context-parallel
        groups; one error line for a model that cannot be split. Not a collective."""
        try:
            enable_context_parallel(
                model, self.cp, self.accelerator.device, trained=trained, dtype=self.dtype
            )
        except ValueError as e:
            raise ArgumentError(str(e)) from e

    @property
    def sampling_ranks(self) -> tuple[int, int]:
        """``(groups, this rank's group)`` of the round's samples: every rank, or under context
        parallelism the groups of K ranks (each rank of a group draws the same samples)."""
        if self.cp is not None:
            return self.cp.data_parallel_size, self.cp.data_parallel_rank
        return self.accelerator.num_processes, self.accelerator.process_index

    def _placements(self) -> dict[str, str]:
        """``{frozen component: placement}``; a placement flag for a component the family lacks
        is an ``ArgumentError``."""
        family = self.family
        given_placements = component_placements(self.args)
        out = {}
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "vae"):
            given = given_placements.get(name)
            if name not in family.frozen_components:
                if given is not None:
                    raise ArgumentError(f"--{name}_placement: {family.pipeline_class} has no {name}")
                continue
            out[name] = given or "replicate"
        return out

    def _needs_reference(self) -> bool:
        return self.args.kl_beta > 0

    # ------------------------------------------------------------------ model calls

    def _velocity(
        self, model, x: torch.Tensor, sigma: torch.Tensor, batch: Round | Conditioning, rows: slice, *,
        train: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """The model's velocity at ``x`` (``[n, ...]``) and per-sample ``sigma`` ``[n]`` for the
        rows ``rows`` of the round, with classifier-free guidance when asked: ``--guidance_scale``
        while sampling, ``--train_guidance_scale`` for a training forward (``train``: the trained
        policy's, the old policy's and the reference's), whose unconditional branch is detached
        (flow_grpo's ``compute_log_prob``: the gradient flows through the conditional branch
        only). Collective when the model is sharded."""
        scale = self.args.train_guidance_scale if train else self.args.guidance_scale
        cond = {k: v[rows] for k, v in batch.cond.items()}
        # fp32, as the scheduler's timesteps the pipelines pass: bf16 would round 999.5 to 1000
        # (steps of 4 near 1000); the family's predict casts where its pipeline does, and a
        # model that embeds in its own dtype (Flux, Qwen-Image) casts inside its forward
        t = sigma.float() * 1000
        if self.guidance_embeds:
            return self.family.predict(model, x.to(self.dtype), t, cond, guidance_scale=scale).float()
        if batch.uncond is None or scale == 1:
            return self.family.predict(model, x.to(self.dtype), t, cond).float()
        both = {k: cat_padded(batch.uncond[k][rows], v) for k, v in cond.items()}
        v_u, v_c = (
            self.family.predict(model, torch.cat([x, x]).to(self.dtype), torch.cat([t, t]), both)
            .float()
            .chunk(2)
        )
        return self.family.guided_velocity(v_u.detach() if train else v_u, v_c, scale)

    @contextlib.contextmanager
    def _old_policy(self):
        """DiffusionNFT's old policy swapped into the denoiser for the block (sampling, ``v_old``);
        the trained weights are back after it. Nothing to swap where the old policy is the trained
        one (GRPO, ``--nft_decay_type 0``); each expert's for Wan 2.2 A14B. Collective when the
        denoiser has whole parameters."""
        with contextlib.ExitStack() as stack:
            for average in (self.old_policy, self.second_old_policy):
                if average is not None:
                    stack.enter_context(average.averaged_weights())
            yield

    @contextlib.contextmanager
    def _reference(self, part: TrainedModel):
        """The reference policy of the trained ``part`` for the block: its frozen copy, or the
        LoRA denoiser with its adapters disabled (restored in ``finally``)."""
        if self.reference is not None:
            yield self.references[part.name]
            return
        part.module.disable_adapters()
        try:
            yield part.engine
        finally:
            part.module.enable_adapters()

    @contextlib.contextmanager
    def _averaged_weights(self):
        """Every trained part's EMA (``--use_ema``) in its weights for the block. Collective."""
        with contextlib.ExitStack() as stack:
            for part in (self.part, *self._second_parts()):
                if part.ema is not None:
                    stack.enter_context(part.ema.averaged_weights())
            yield

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The family's conditioning of ``prompts``. Collective when an encoder is sharded."""
        ids = self.family.tokenize(self.tokenizers, prompts, self.args.max_sequence_length)
        outputs = self.family.encode_texts(self.frozen.models, ids)
        return conditioning_on(self.family, outputs, self.accelerator.device, self.dtype)

    @torch.no_grad()
    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] of denoiser latents (``decode_images``: the family's normalisation
        undone as its pipeline does). Collective when the VAE is sharded."""
        return decode_images(self.family, self.vae, self.frozen.normalize_latents, latents)

    # ------------------------------------------------------------------ one round

    @torch.no_grad()
    def sample_round(self, round_index: int) -> Round:
        """This rank's padded samples of a round with their SDE trajectories (no gradient), drawn
        from the old policy where DiffusionNFT keeps one (as its reference samples). Collective:
        every rank makes the same number of every model call."""
        args, acc = self.args, self.accelerator
        device = acc.device
        groups, group = self.sampling_ranks
        pairs = group_assignment(
            args.prompts_per_round, args.group_size, groups, group, round_index, args.seed,
            dataset_size=len(args.prompts),
        )  # fmt: skip
        length = samples_per_rank(args.prompts_per_round, args.group_size, groups)
        padded, real = pad_assignment(pairs, length)
        prompts = [args.prompts[p] for p, _ in padded]
        metadata = [self.prompt_metadata[p] for p, _ in padded]
        cond = self._encode(prompts)
        uncond = self._encode([""] * len(prompts)) if self.cfg else None
        shape = self.family.sample_latent_shape(
            self.vae.config, args.resolution, args.resolution, self.num_frames
        )
        sigmas = self._sampling_sigmas(shape)
        # each sample's own CPU generator (the same noise on any device and rank) draws its initial
        # latents and then every step's noise, all up front: one copy to the device (pinned and
        # non-blocking on CUDA), not a pageable copy and a sync at every step
        generators = [sample_generator(args.seed, round_index, p, m) for p, m in padded]
        starts = generators
        if args.same_noise_per_group:  # each group's own generator: its members' initial noise
            starts = [group_noise_generator(args.seed, round_index, p) for p, _ in padded]
        # CPU: each sample's own CPU generator (the same noise on any device and rank), then moved
        latents = host_to_device(torch.cat([torch.randn(1, *shape, generator=g) for g in starts]), device)
        step_noise = host_to_device(
            torch.stack([
                # CPU: the same generators' step noise, drawn up front, then moved in one copy
                torch.cat([torch.randn(1, *shape, generator=g) for _ in range(args.num_inference_steps)])
                for g in generators
            ]),
            device,
        )  # fmt: skip
        batch = Round(
            index=round_index, pairs=padded, real=torch.tensor(real, device=device), prompts=prompts, metadata=metadata, cond=cond,
            uncond=uncond, latents=latents.new_empty(length, args.num_inference_steps + 1, *shape),
            log_probs=latents.new_empty(length, args.num_inference_steps), sigmas=sigmas,
        )  # fmt: skip
        batch.latents[:, 0] = latents
        if args.ratio_norm:
            batch.means = latents.new_empty(length, args.num_inference_steps, *shape)
        if args.sde_window_size:
            batch.window = round_window(
                args.seed, round_index, args.sde_window_size, tuple(args.sde_window_range)
            )
        start, end = batch.window or (0, args.num_inference_steps)
        for rows in _chunks(length, args.sample_batch_size):
            x = latents[rows]
            with self._old_policy():
                for i in range(args.num_inference_steps):
                    n = x.shape[0]
                    v = self._velocity(self._sampling_model(sigmas[i]), x, sigmas[i].expand(n), batch, rows)
                    x, log_prob, mean, _ = sde_step_with_logprob(
                        v,
                        sigmas[i],
                        sigmas[i + 1],
                        x,
                        # deterministic (noise level 0: the Euler step) outside the SDE window
                        noise_level=args.noise_level if start <= i < end else 0.0,
                        noise=step_noise[rows, i],
                        sampler=args.sampler,
                    )
                    batch.latents[rows, i + 1] = x
                    batch.log_probs[rows, i] = log_prob
                    if batch.means is not None:
                        batch.means[rows, i] = mean
        batch.scored, batch.images = self._decode_share(batch.latents[:, -1])
        return batch

    def _decode_share(self, latents: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The rows of a round's clean ``latents`` ``[P, ...]`` this rank decodes (and then scores):
        every row, or under context parallelism every K-th from its place in its group (the
        group's ranks hold the same samples: each decodes and scores a share, not all). The
        same number of decode calls on every rank (a short share decodes a dummy row and drops
        it): a sharded VAE stays in lockstep. Collective when the VAE is sharded."""
        size, place = (self.cp.size, self.cp.group_rank) if self.cp is not None else (1, 0)
        rows = list(range(place, len(latents), size))
        chunk = self.args.sample_batch_size
        calls = share_calls(len(latents), size, chunk)
        images = []
        for c in range(calls):
            part = rows[c * chunk : (c + 1) * chunk]
            decoded = self._decode(latents[part or [0]])
            images.append(decoded[: len(part)])  # an empty share keeps the images' shape
        return rows, torch.cat(images)

    def _sampling_sigmas(self, shape: tuple[int, ...], steps: int | None = None) -> torch.Tensor:
        """The sampling schedule ``[T + 1]`` (ending at 0) of ``steps`` (default
        ``--num_inference_steps``) for denoiser latents of ``shape``, as the family's pipeline
        sets it (``sampling_schedule``), on the device in fp32. Not a collective."""
        return sampling_schedule(
            self.family, self.scheduler, steps or self.args.num_inference_steps, shape, self.vae.config,
            self.part.module.config, self.accelerator.device,
        )  # fmt: skip

    def score_round(self, batch: Round) -> tuple[float, dict[str, float]]:
        """Score every sample's decoded image (dummies too, then dropped; the images are
        released), fill the advantages (``--global_std``), each sample's weight in the loss
        (``rl.kept_sample_weight``: ``--filter_zero_std``) and the reward's spread in ``batch.stats``
        (``gather_group_reward_stats``); return the round's mean weighted reward and each
        reward's mean over every rank's real samples. Collective."""
        args, acc = self.args, self.accelerator
        totals, per_spec = [], {name: [] for name in self.reward_names}
        prompts = [batch.prompts[i] for i in batch.scored]
        metadata = [batch.metadata[i] for i in batch.scored]
        for rows, groups in self._reward_calls(batch):
            extra = {"groups": groups} if groups is not None else {}
            total, scores = self.reward_fn(
                batch.images[rows], prompts[rows], metadata=metadata[rows], **extra
            )
            totals.append(total)
            for name in self.reward_names:
                per_spec[name].append(scores[name])
        scored = torch.stack([torch.cat(totals), *(torch.cat(v) for v in per_spec.values())], dim=1)
        grid_every = args.sample_grid_steps or args.checkpointing_steps
        if acc.is_main_process and (batch.index + 1) % grid_every == 0:
            shown = batch.real[batch.scored].tolist()
            save_sample_grid(
                Path(args.output_dir) / "samples", batch.index + 1, batch.images[batch.real[batch.scored]],
                [q for q, keep in zip(prompts, shown) if keep], scored[:, 0][batch.real[batch.scored]].tolist(),
            )  # fmt: skip
        batch.images = None
        every = self._group_scores(scored.to(acc.device), len(batch.pairs))  # [P, 1 + rewards]
        real = batch.real
        total = every[:, 0][real]
        per_spec = {name: [every[:, 1 + k]] for k, name in enumerate(self.reward_names)}
        groups = torch.tensor([p for p, _ in batch.pairs], device=total.device)[real]
        advantages = torch.zeros(len(batch.pairs), device=acc.device)
        advantages[real] = gather_group_advantages(total, groups, global_std=args.global_std).to(acc.device)
        batch.advantages = advantages
        batch.weight = kept_sample_weight(advantages, real, args.filter_zero_std)
        batch.stats.update(gather_group_reward_stats(total, groups))
        means = {name: self._global_mean(torch.cat(v)[real]) for name, v in per_spec.items()}
        return self._global_mean(total), means

    def _group_scores(self, scored: torch.Tensor, length: int) -> torch.Tensor:
        """Every sample's scores ``[length, R]`` from each rank's scores of the samples it scored
        (``Round.scored``): its own rows, or under context parallelism its group's ranks' shares
        put back in order (one all-gather of every rank's share, padded to the largest).
        Collective under context parallelism."""
        if self.cp is None:
            return scored
        size, group = self.cp.size, self.cp.data_parallel_rank
        largest = -(-length // size)
        padded = scored.new_zeros(largest, scored.shape[1])
        padded[: len(scored)] = scored
        shares = self.accelerator.gather(padded[None]).reshape(-1, largest, scored.shape[1])
        every = scored.new_empty(length, scored.shape[1])
        for place in range(size):
            rows = range(place, length, size)
            every[place::size] = shares[group * size + place, : len(rows)]
        return every

    def _reward_calls(self, batch: Round) -> Iterator[tuple[slice, SampleGroups | None]]:
        """The reward calls of the samples this rank scores (``Round.scored``): chunks of
        ``--sample_batch_size``; one call of them all with each sample's group, member and
        realness when a reward is group-wise (``rewards.groupwise``: it gathers every rank's
        members of a group, so it must see the round at once; the other rewards then take the
        round in one call too)."""
        if not self.groupwise_rewards:
            # the same number of calls on every rank (a short share's last ones empty): each is collective
            size = self.cp.size if self.cp is not None else 1
            chunk = self.args.sample_batch_size
            for c in range(share_calls(len(batch.pairs), size, chunk)):
                yield slice(min(c * chunk, len(batch.scored)), min((c + 1) * chunk, len(batch.scored))), None
            return
        pairs = [batch.pairs[i] for i in batch.scored]
        prompts, members = zip(*pairs) if pairs else ((), ())
        yield slice(0, len(pairs)), SampleGroups(prompts, members, batch.real[batch.scored].tolist())

    def _global_mean(self, values: torch.Tensor) -> float:
        """The mean over every rank's ``values`` (any count per rank). Collective."""
        stats = torch.stack([values.double().sum(), torch.tensor(float(len(values)), device=values.device)])
        stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum")
        return (stats[0] / stats[1]).item()

    def _trained_steps(self, batch: Round) -> torch.Tensor:
        """``[E, P, K]``: for each inner epoch and sample, the indices of the ``K`` sampled steps it
        trains on, in order (``rl.trained_timestep_indices``; ``--timestep_subset random``: each
        sample's own subset per inner epoch, from ``timestep_generator``, the same on any rank),
        among the window's steps; for Wan 2.2 A14B among those of the round's expert
        (``round_part``). Not a collective."""
        args = self.args
        start, end = batch.window or (0, args.num_inference_steps)
        engine = self.round_part(batch.index).engine
        # CPU: indices into the round's stored steps, moved with the rest below
        candidates = torch.tensor(
            [i for i in range(start, end) if self._sampling_model(batch.sigmas[i]) is engine]
        )
        steps = [
            torch.stack([
                candidates[trained_timestep_indices(
                    len(candidates), args.train_timesteps, args.timestep_subset,
                    timestep_generator(args.seed, batch.index, p, m, epoch),
                )]
                for p, m in batch.pairs
            ])
            for epoch in range(args.num_inner_epochs)
        ]  # fmt: skip
        return torch.stack(steps).to(batch.latents.device)

    @torch.no_grad()
    def _prepare_nft(self, batch: Round) -> None:
        """DiffusionNFT's training points before any update: for each inner epoch and trained
        slot, each sample's clean latents noised afresh at its trained step's sigma (clamped to
        0.999; the noise from ``nft_noise_generator``: the same on any rank and any number of
        ranks) and the old policy's velocity there (the round's sampling policy: the old policy
        is fixed within a round). Collective."""
        args = self.args
        x0 = batch.latents[:, -1]
        engine = self.round_part(batch.index).engine
        points = []
        with self._old_policy():
            for epoch in range(args.num_inner_epochs):
                slots = []
                for k in range(args.train_timesteps):
                    index = batch.steps[epoch, :, k]
                    sigma = batch.sigmas[index].clamp(max=0.999)  # at sigma 1 x_t holds no trace of x0
                    noise = torch.cat([
                        # CPU: each sample's own CPU generator (the same noise on any device and rank), then moved
                        torch.randn(1, *x0.shape[1:], generator=nft_noise_generator(args.seed, batch.index, p, m, i, epoch))
                        for (p, m), i in zip(batch.pairs, index.tolist())
                    ]).to(x0.device)  # fmt: skip
                    s = sigma.view(-1, *[1] * (x0.ndim - 1))
                    x_t = (1 - s) * x0 + s * noise
                    v_old = torch.cat([
                        self._velocity(engine, x_t[rows], sigma[rows], batch, rows, train=True)
                        for rows in _chunks(len(x0), args.train_batch_size)
                    ])  # fmt: skip
                    slots.append((x_t, v_old, sigma))
                points.append(slots)
        batch.nft_points = points

    def _loss(
        self, batch: Round, epoch: int, k: int, rows: slice
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of inner epoch ``epoch``'s trained slot ``k`` on the rows ``rows``: each
        sample at its own trained step (``batch.steps``), over the samples of weight above 0
        (``batch.weight``: no dummy, no filtered sample), scaled by the rows' total weight over
        their number (a micro-batch's loss is its weighted sum over ``--train_batch_size``).
        Collective: the policy (and reference) forwards run for every row."""
        args = self.args
        part = self.round_part(batch.index)
        weight = batch.weight[rows]
        keep = weight > 0
        n, kept = rows.stop - rows.start, int(keep.sum())
        share = weight.sum().item() / n
        adv = batch.advantages[rows][keep]
        index = batch.steps[epoch, rows, k]
        if args.objective == "grpo":
            at = torch.arange(n, device=index.device)
            x, x_next = batch.latents[rows][at, index], batch.latents[rows][at, index + 1]
            sigma, sigma_next = batch.sigmas[index], batch.sigmas[index + 1]
            v = self._velocity(part.engine, x, sigma, batch, rows, train=True)
            _, log_prob, mean, std = sde_step_with_logprob(
                v,
                sigma,
                sigma_next,
                x,
                noise_level=args.noise_level,
                prev_sample=x_next,
                sampler=args.sampler,
            )
            kl = None
            if args.kl_beta > 0:
                with torch.no_grad(), self._reference(part) as reference:
                    v_ref = self._velocity(reference, x, sigma, batch, rows, train=True)
                    _, _, ref_mean, _ = sde_step_with_logprob(
                        v_ref, sigma, sigma_next, x, noise_level=args.noise_level, prev_sample=x_next
                    )
                kl = sde_kl(mean, ref_mean, std)[keep]
            if kept == 0:
                return log_prob.float().sum() * 0.0, {}  # its backward still runs: ranks in lockstep
            old_log_prob = batch.log_probs[rows][at, index][keep]
            log_ratio = None
            if args.ratio_norm:  # GRPO-Guard: the step's std, sqrt(sigma - sigma_next) * std_dev_t
                step_std = std * (sigma - sigma_next).sqrt().view(-1, *[1] * (x.ndim - 1))
                log_ratio = guard_log_ratio(
                    log_prob[keep],
                    old_log_prob,
                    mean[keep],
                    batch.means[rows][at, index][keep],
                    step_std[keep],
                )
            loss, stats = grpo_loss(
                log_prob[keep], old_log_prob, adv, clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
                kl=kl, kl_beta=args.kl_beta, log_ratio=log_ratio,
            )  # fmt: skip
            return loss * share, stats
        x_t, v_old, sigma = (t[rows] for t in batch.nft_points[epoch][k])
        v = self._velocity(part.engine, x_t, sigma, batch, rows, train=True)
        v_ref = None
        if args.kl_beta > 0:
            with torch.no_grad(), self._reference(part) as reference:
                v_ref = self._velocity(reference, x_t, sigma, batch, rows, train=True)[keep]
        if kept == 0:
            return v.float().sum() * 0.0, {}
        settings = NftSettings(
            beta=args.nft_beta,
            adv_clip_max=args.adv_clip_max,
            adv_mode=args.nft_adv_mode,
            kl_beta=args.kl_beta,
        )
        loss, stats = nft_loss(
            v[keep],
            v_old[keep],
            x_t[keep],
            batch.latents[rows, -1][keep],
            sigma[keep],
            adv,
            settings,
            v_ref=v_ref,
        )
        return loss * share, stats

    def train_round(self, batch: Round) -> float:
        """The round's updates: inner epochs x micro-batches x trained slots, one backward each,
        the optimizer stepped once per ``--gradient_accumulation_steps`` micro-batches on the
        mean of their backwards' gradients (``--step_every_timestep``: per
        ``--gradient_accumulation_steps`` backwards), the EMA updated as the references' and,
        after the round, DiffusionNFT's old policy moved toward the trained weights
        (``rl.nft_old_decay``); returns the mean loss, and puts the loss's statistics
        (``LOSS_STATS``: each backward's over its kept samples, weighted by their number, over
        every rank) in ``batch.stats``. Collective."""
        args, acc = self.args, self.accelerator
        batch.steps = self._trained_steps(batch)
        if args.objective == "nft":
            self._prepare_nft(batch)
        names = LOSS_STATS[args.objective]
        # sums of each statistic times its kept samples, then the number of kept samples
        sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=acc.device)
        losses = []
        bad = torch.zeros((), dtype=torch.bool, device=acc.device)  # a non-finite loss in this update
        part = self.round_part(batch.index)  # Wan 2.2 A14B: the round's expert
        ddp_parts = [
            p.engine for p in self._second_parts() if not p.own_engine
        ]  # accelerate's, without ZeRO-3
        for epoch in range(args.num_inner_epochs):
            for rows in _chunks(len(batch.pairs), args.train_batch_size):
                for k in range(args.train_timesteps):
                    # accelerate syncs (and DeepSpeed steps) every accumulation_steps backwards: at
                    # the last trained slot of every --gradient_accumulation_steps-th micro-batch;
                    # the loss is divided by their number
                    with acc.accumulate(self.engine, *ddp_parts):
                        loss, stats = self._loss(batch, epoch, k, rows)
                        bad = bad | ~torch.isfinite(loss.detach())  # no host sync
                        self._backward(part, loss)
                        applied = step_part(part, acc, acc.sync_gradients)
                    if acc.sync_gradients:
                        flags = (
                            [] if applied else acc.gather(bad.float().reshape(1)).tolist()
                        )  # every rank alike
                        ranks = [rank for rank, flag in enumerate(flags) if flag]
                        if self.nonfinite.record(applied, self._optimizer_steps(), ranks):
                            self.optimizer_steps += 1
                            self._update_ema(part)
                        bad = torch.zeros((), dtype=torch.bool, device=acc.device)
                    losses.append(loss.detach().float())
                    if stats:  # none for a micro-batch without a kept sample
                        n_kept = (batch.weight[rows] > 0).sum().double()
                        sums += torch.stack([*(stats[name].double() * n_kept for name in names), n_kept])
        for average in (self.old_policy, self.second_old_policy):
            if average is not None:
                average.update(nft_old_decay(self._optimizer_steps(), args.nft_decay_type))
        sums = acc.reduce(sums, reduction="sum")
        batch.stats.update(
            {k: (v / sums[-1]).item() if sums[-1] > 0 else math.nan for k, v in zip(names, sums)}
        )
        return torch.stack(losses).mean().item()

    def _backward(self, part: TrainedModel, loss: torch.Tensor) -> None:
        """The backward of ``part``'s loss (times K under context parallelism): accelerate's for
        the first part (its engine) and for accelerate's others, the part's own engine's (its
        accumulation boundary where accelerate's is) for Wan 2.2 A14B's low-noise expert under
        ZeRO-3. Collective: every rank, every micro-batch."""
        if self.cp is not None:  # ZeRO-3 averages over every rank: a group's shares make one sample
            loss = self.cp.group_loss(loss)
        if part.own_engine:
            part.engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
            part.engine.backward(loss)
        else:
            self.accelerator.backward(loss)

    def _update_ema(self, part: TrainedModel) -> None:
        """After an optimizer step of ``part``: its EMA (``--use_ema``) as the references'
        ``EMAModuleWrapper``, decay ``min((1 + s) / (10 + s), --ema_decay)`` at every
        ``--ema_update_every``-th step ``s``. Local: no collective."""
        if part.ema is None:
            return
        step = self._optimizer_steps()
        if reference_ema_updates(step, self.args.ema_update_every):
            part.ema.update(reference_ema_decay(step, self.args.ema_decay))

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        """Rounds until ``--max_train_steps``: sample, score, train, log, checkpoint. Collective.
        A ``step N reward X loss Y (...)`` line per round: on a terminal only into
        ``OUTPUT_DIR/<logging_dir>/train.log`` beside a progress bar of rounds, elsewhere
        printed as well (``training.report.StepOutput``)."""
        args, acc = self.args, self.accelerator
        with (
            StepOutput.of_run(args, acc, self.global_step, unit="round") as steps,
            self.stop_signals,
        ):
            while self.global_step < args.max_train_steps:
                self._evaluate_when_due()
                self._round(steps)
                self._stop_when_signalled()
            self._evaluate_when_due()

    def _round(self, steps: StepOutput) -> None:
        """One round: sample, score, train, log, checkpoint. Collective."""
        args, acc = self.args, self.accelerator
        device = acc.device
        start = wall_clock(device)
        batch = self.sample_round(self.global_step)  # text encoding, the SDE loop, the VAE decode
        sampled = wall_clock(device)
        mean, means = self.score_round(batch)  # the reward calls and the advantage gather
        scored = wall_clock(device)
        loss = self.train_round(batch)  # the inner epochs with their optimizer steps
        seconds = dict(zip(PHASES, (sampled - start, scored - sampled, wall_clock(device) - scored)))
        self.global_step += 1
        self.trained_rounds += 1
        self.rewards.append(mean)
        for name, value in means.items():
            self.rewards_by_spec[name].append(value)
        for phase, value in seconds.items():
            self.seconds[phase].append(value)
        for name, values in self.stats.items():
            values.append(batch.stats[name])
        acc.log({"reward": mean, "loss": loss, **{f"reward/{k}": v for k, v in means.items()},
                 **{f"seconds/{k}": v for k, v in seconds.items()},
                 **{f"stats/{k}": v[-1] for k, v in self.stats.items()}}, step=self.global_step)  # fmt: skip
        each = " ".join(f"{k} {v:.6f}" for k, v in means.items())
        took = " ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
        trained = f"; trained {self.round_part(self.global_step - 1).name}" if self.second is not None else ""
        steps.step(
            f"step {self.global_step} reward {mean:.6f} loss {loss:.6f} ({each}) time: {took}; "
            f"optimizer steps {self._optimizer_steps()}{trained}",
            reward=f"{mean:.4f}",
            loss=f"{loss:.4f}",
        )
        if self.global_step % args.checkpointing_steps == 0:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """The round's checkpoint (its rewards, times, statistics and evaluations with it). Collective."""
        args, acc = self.args, self.accelerator
        save_training_checkpoint(
            acc, args.output_dir, self.global_step,
            {"epoch": 0, "batches_in_epoch": 0, "rewards": self.rewards, "rewards_by_spec": self.rewards_by_spec,
             "seconds": self.seconds, "stats": self.stats, "evaluations": self.evaluations},
            ema=self.ema, total_limit=args.checkpoints_total_limit, averages=self._averages(),
            parts=self._second_parts(),
        )  # fmt: skip

    def _stop_when_signalled(self) -> None:
        """After a round: when any rank got a ``--save_on_signal`` signal, publish the round's
        checkpoint (unless the schedule just did) and stop every rank (``Preempted``). One
        collective (a flag per rank)."""
        received = self.stop_signals.flag()
        flags = self.accelerator.gather(torch.tensor([received], device=self.accelerator.device)).tolist()
        if any(flags):
            self.stop_signals.checkpoint_and_stop(
                "after round", self.global_step, self.args.checkpointing_steps, self._checkpoint
            )

    def _evaluate_when_due(self) -> None:
        """Evaluate before round ``global_step`` when ``--eval_steps`` divides it and it has not been
        evaluated (a resumed run keeps its checkpoint's evaluations). Collective."""
        args = self.args
        due = args.eval_prompt_file and self.global_step % args.eval_steps == 0
        if due and self.global_step not in self.evaluations["round"]:
            self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Sample every ``--eval_prompt_file`` prompt once, deterministically: Euler (ODE) steps of
        the pipeline's schedule (``--eval_num_inference_steps``) from a fixed noise per prompt (the
        same at every evaluation, on any number of ranks), at ``--eval_resolution`` and the
        sampling CFG, with the EMA weights under ``--use_ema`` (as flow_grpo evaluates); score each
        image with every ``--reward`` and ``--eval_reward`` (metadata from a ``.jsonl`` file); put
        the means over every prompt in ``self.evaluations`` and the trackers, and rank 0's images in
        ``samples/eval-N.png``. Returns ``{"mean": total, <reward>: mean, ...}``. Collective: the
        ranks (context-parallel groups) share the prompts, padded to the same count."""
        args, acc, family = self.args, self.accelerator, self.family
        groups, group = self.sampling_ranks
        count = len(self.eval_prompts)
        padded, real = pad_assignment([(i, 0) for i in range(group, count, groups)], -(-count // groups))
        indices = [i for i, _ in padded]
        prompts = [self.eval_prompts[i] for i in indices]
        metadata = [self.eval_metadata[i] for i in indices]
        real = torch.tensor(real, device=acc.device)
        text = Conditioning(self._encode(prompts), self._encode([""] * len(prompts)) if self.cfg else None)
        shape = family.sample_latent_shape(
            self.vae.config, args.eval_resolution, args.eval_resolution, self.num_frames
        )
        sigmas = self._sampling_sigmas(shape, args.eval_num_inference_steps)
        noise = torch.cat(
            [
                # CPU: a CPU generator per prompt (the same noise at every evaluation, on any device), then moved
                torch.randn(1, *shape, generator=_hashed_generator(f"grpo-eval:{args.seed}:{i}"))
                for i in indices
            ]
        )
        images = []
        with self._averaged_weights():
            for rows in _chunks(len(indices), args.sample_batch_size):
                x = noise[rows].to(acc.device)
                for i in range(args.eval_num_inference_steps):
                    v = self._velocity(
                        self._sampling_model(sigmas[i]), x, sigmas[i].expand(x.shape[0]), text, rows
                    )
                    x = x + (sigmas[i + 1] - sigmas[i]) * v  # the scheduler's Euler step, in fp32
                images.append(self._decode(x))
        images = torch.cat(images)
        totals, scores = [], {}
        for rows in _chunks(len(indices), args.sample_batch_size):
            total, each = self.reward_fn(images[rows], prompts[rows], metadata=metadata[rows])
            if self.eval_reward_fn is not None:
                each = {
                    **each,
                    **self.eval_reward_fn(images[rows], prompts[rows], metadata=metadata[rows])[1],
                }
            totals.append(total)
            for name, value in each.items():
                scores.setdefault(name, []).append(value)
        means = {"mean": self._global_mean(torch.cat(totals).to(acc.device)[real])}
        means.update(
            {name: self._global_mean(torch.cat(v).to(acc.device)[real]) for name, v in scores.items()}
        )
        self.evaluations["round"].append(self.global_step)
        for name, value in means.items():
            self.evaluations[name].append(value)
        acc.log({f"eval/{k}": v for k, v in means.items()}, step=self.global_step)
        log_rank_zero(
            f"evaluation before round {self.global_step + 1}: "
            + " ".join(f"{k} {v:.6f}" for k, v in means.items())
        )
        if acc.is_main_process:
            shown = real.cpu().tolist()
            save_sample_grid(
                Path(args.output_dir) / "samples", self.global_step, images[real],
                [q for q, keep in zip(prompts, shown) if keep], torch.cat(totals)[real].tolist(), stem="eval",
            )  # fmt: skip
        return means

    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far: DeepSpeed's own count under DeepSpeed (restored on
        resume), else this process's. Not a collective."""
        if self.accelerator.state.deepspeed_plugin is not None:
            return sum(int(p.engine.global_steps) for p in (self.part, *self._second_parts()))
        return self.optimizer_steps

    def save(self) -> None:
        """The pipeline (full) or ``pytorch_lora_weights.safetensors`` (LoRA), ``rewards.json``
        and a reward curve per reward, then the summary of what the run wrote. Collective."""
        args = self.args
        out = Path(args.output_dir)
        others = {p.name: p.engine for p in self._second_parts()}  # Wan 2.2 A14B's low-noise expert
        if args.rank is not None:
            with self._averaged_weights():
                path = save_lora_zero3(self.engine, self.family, out, others=others)
            weights = ("LoRA weights", path)
        else:
            family = self.family  # the card draws as a round samples: its steps and size
            call = {"num_inference_steps": args.num_inference_steps, **family.size_kwargs(args.resolution, args.resolution),
                    **family.validation_kwargs(args.max_sequence_length, None)}  # fmt: skip
            card = model_card(args.pretrained_model_name_or_path, f"online RL ({args.objective}): {', '.join(args.reward)}",
                              args.scalars(), args.prompts, family.pipeline_class, family.task, call)  # fmt: skip
            save_final_pipeline(self.source, out, self.engine, ema=self.ema, readme=card,
                                denoiser_name=self.family.denoiser,
                                trained={p.name: (p.engine, p.ema) for p in self._second_parts()})  # fmt: skip
            weights = ("pipeline", out, f"{self.family.pipeline_class}.from_pretrained")
        if self.accelerator.is_main_process:
            curves = self._write_rewards(out)
            log_outputs([
                weights,
                ("rewards", out / "rewards.json", "per round: the total, each reward, each phase's seconds, the stats"),
                ("evaluations", out / "eval.json" if self.evaluations["round"] else None,
                 "the round before which each ran, the total's and each reward's mean"),
                ("evaluation curve", out / "eval.png" if self.evaluations["round"] else None),
                *((f"{name} curve", file) for name, file in curves.items()),
                ("sample grids", out / "samples", "round-N.png, each sample's prompt and reward in round-N.json"),
                *run_logs(args),
            ])  # fmt: skip
        finish_trackers(self.accelerator)

    def _write_rewards(self, out: Path) -> dict[str, Path]:
        """``rewards.json`` (``"mean"``: the weighted total per round, one list per reward spec,
        ``"seconds"``: rank 0's wall-clock seconds of each phase per round, and ``"stats"``: per
        round the total's ``REWARD_STATS`` over every rank and the loss's ``LOSS_STATS``) and the curves:
        ``rewards.png`` for the total, ``rewards-<reward>.png`` for each reward
        (``reward_plot_name``). Returns the curves written, ``{"total reward": path, <reward
        spec name>: path, ...}``. Main process only (no collective)."""
        out.mkdir(parents=True, exist_ok=True)
        (out / "rewards.json").write_text(
            json.dumps(
                {"mean": self.rewards, **self.rewards_by_spec, "seconds": self.seconds, "stats": self.stats}
            )
        )
        if self.evaluations["round"]:
            (out / "eval.json").write_text(json.dumps(self.evaluations))
            rounds = self.evaluations["round"]
            every = rounds[1] - rounds[0] if len(rounds) > 1 else 1
            plot_curve(self.evaluations["mean"], out / "eval.png",
                       f"evaluation (total reward) before rounds {rounds[0] + 1}, {rounds[0] + 1 + every}, ...",
                       axes=CurveAxes(f"evaluation (every {every} rounds)",
                                      "total reward (mean over the evaluation prompts)"))  # fmt: skip
        curves = [("total reward", "mean", self.rewards, out / "rewards.png")]
        for name, values in self.rewards_by_spec.items():
            taken = {file.name for *_, file in curves}
            curves.append((name, name, values, out / reward_plot_name(name, taken)))
        written = {}
        for label, name, values, file in curves:
            if not values:
                continue
            title = f"{name} per round: {values[0]:.3f} -> {values[-1]:.3f}"
            plot_curve(values, file, title, axes=CurveAxes("round", f"{name} (mean of the round's samples)"),
                       smooth=min(10, max(1, len(values) // 5)))  # fmt: skip
            written[label] = file
        k, first, last = first_last_means(self.rewards)
        log_rank_zero(f"mean reward: first {k} rounds {first:.4f} -> last {k} rounds {last:.4f}")
        return written


def reward_plot_name(name: str, taken: set[str] = frozenset()) -> str:
    """The file name of a reward's curve: ``rewards-<name>.png``, the spec's name with every
    character but letters, digits, ``.``, ``_`` and ``-`` made ``-``; a name already in
    ``taken`` gets ``-2``, ``-3``, ... (two specs that differ only in those characters).

    Example:
        >>> reward_plot_name("diffusers_zero3.demo.rewards:redness")
        'rewards-diffusers_zero3.demo.rewards-redness.png'
        >>> reward_plot_name("clip_score", taken={"rewards-clip_score.png"})
        'rewards-clip_score-2.png'
    """
    stem = "rewards-" + (re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "reward")
    file, n = f"{stem}.png", 1
    while file in taken:
        n += 1
        file = f"{stem}-{n}.png"
    return file


__all__ = [
    "GRPOSettings",
    "GRPOTrainer",
    "LORA_WEIGHT_NAME",
    "PHASES",
    "cat_padded",
    "decode_images",
    "nft_noise_generator",
    "pad_assignment",
    "pipeline_sigmas",
    "reward_plot_name",
    "sampling_schedule",
    "set_sampling_timesteps",
    "sample_generator",
    "wall_clock",
]
