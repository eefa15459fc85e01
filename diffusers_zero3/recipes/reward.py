"""Reward fine-tuning of a Stable Diffusion UNet under DeepSpeed ZeRO-3 (AlignProp / DRaFT-K):
the trainer behind ``scripts/train_reward.py``.

Every rank samples its own prompts, runs the DDIM sampler (the last K denoising steps with
gradients), decodes with the VAE, and scores the images with a reward model that is itself
sharded as a ZeRO-3 inference engine (``ParallelReward``, called on every rank in lockstep).
The loss ``-mean(reward)`` is backpropagated through the reward model, the VAE decode and
the last K UNet calls into the UNet, a ZeRO-3 engine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import torch

from ..args import (
    ENGINE_PLACEMENT_CHOICES,
    PLACEMENTS_GROUP,
    ArgumentError,
    CheckpointSettings,
    FaultSettings,
    OptimizerSettings,
    ProcessSettings,
    TrackingSettings,
    check_positive,
    flag,
    placement_flag,
    redefault,
    validate_common_args,
    validate_launch,
)
from ..families import SD, detect_family
from ..placement.frozen import load_frozen_component
from ..rewards import RewardSpec, load_rewards, parse_reward_specs
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import weight_dtype
from ..runtime.memory import return_large_frees_to_os
from ..runtime.notices import quiet_library_notices
from ..state.pipeline_io import (
    CurveAxes,
    check_output_dir,
    model_card,
    pipeline_components,
    plot_curve,
    save_final_pipeline,
)
from ..state.pretrained import resolve_model_folder
from ..state.resume import resume_training, save_training_checkpoint
from ..training.faults import NonFiniteUpdates, StopSignals, nonfinite_ranks, parse_signals
from ..training.job import (
    accelerator_from_args,
    clear_interrupted_writes,
    finish_trackers,
    load_trainable_denoiser,
)
from ..training.parts import adamw, prepare_first_part, set_micro_batch_size, step_part
from ..training.report import StepOutput, log_outputs, run_logs, step_log_path
from ..training.schedule import first_last_means


@dataclasses.dataclass
class RewardSettings(FaultSettings, ProcessSettings, CheckpointSettings, TrackingSettings, OptimizerSettings):
    """The settings of ``scripts/train_reward.py`` (AlignProp / DRaFT-K)."""

    DESCRIPTION: ClassVar[str] = (
        "Reward fine-tuning of a Stable Diffusion UNet under DeepSpeed ZeRO-3 (AlignProp / DRaFT-K)."
    )
    # one backward per optimizer step: not a flag
    gradient_accumulation_steps: ClassVar[int] = 1
    tracker_project_name: str = redefault(TrackingSettings, "tracker_project_name", "reward-fine-tune")
    text_encoder_placement: str = placement_flag(
        "replicate", "Where the text encoder lives.", ENGINE_PLACEMENT_CHOICES
    )
    vae_placement: str = placement_flag("replicate", "Where the VAE lives.", ENGINE_PLACEMENT_CHOICES)
    reward_placement: list[str] = flag(
        [],
        "NAME=shard|replicate|offload: where a reward model lives; a bare placement applies to every "
        "reward model (default shard). Repeatable.",
        append=True,
        group=PLACEMENTS_GROUP,
    )
    pretrained_model_name_or_path: str | None = flag(None, "Pipeline folder or hub id.", required=True)
    reward: list[str] = flag(
        [],
        "SPEC[=WEIGHT]: a reward of the weighted sum (a built-in name, module:function or module:Class; "
        "see docs/rl.md). Repeatable.",
        append=True,
        metavar="SPEC[=WEIGHT]",
    )
    reward_model: list[str] = flag(
        [], "NAME=PATH_OR_HUB_ID: the weights of a reward model of --reward. Repeatable.", append=True
    )
    reward_model_name_or_path: str | None = flag(
        None,
        "Folder of a reward model of --reward_model_class (the same as --reward CLASS "
        "--reward_model CLASS=FOLDER).",
    )
    reward_model_class: str = flag("diffusers_zero3.demo:RednessRewardModel", "module:Class of it.")
    prompts: list[str] | None = flag(None, "Prompts to sample from.", required=True)
    output_dir: str = flag("sd-model-reward-finetuned")
    seed: int = flag(0)
    resolution: int = flag(512)
    train_batch_size: int = flag(2, "Samples per rank per step.")
    max_train_steps: int = flag(100)
    num_inference_steps: int = flag(20, "DDIM steps of each sample.")
    truncated_backprop_steps: int = flag(1, "K: last denoising steps with gradients.")
    reward_micro_batch_size: int = flag(4)
    reward_normalize: str | None = flag(None, choices=["batch", "per_prompt"])

    def resolve(self) -> None:
        """Check that K fits the sampler's steps and that the rewards are given one way
        (raise ``ArgumentError``)."""
        if not 1 <= self.truncated_backprop_steps <= self.num_inference_steps:
            raise ArgumentError("--truncated_backprop_steps must be between 1 and --num_inference_steps")
        if self.reward and self.reward_model_name_or_path:
            raise ArgumentError(
                "give the rewards with --reward (and --reward_model), or --reward_model_name_or_path"
            )
        if not self.reward and not self.reward_model_name_or_path:
            raise ArgumentError("train_reward.py needs --reward SPEC (or --reward_model_name_or_path)")


def reward_specs(args: RewardSettings) -> list[RewardSpec]:
    """The recipe's rewards as ``RewardSpec``s of the registry: ``--reward`` / ``--reward_model``
    / ``--reward_placement``, or ``--reward_model_name_or_path`` of ``--reward_model_class``. A
    bare ``--reward_placement`` (no ``NAME=``) applies to every reward model without its own;
    raises ``ArgumentError``."""
    rewards, models = list(args.reward), list(args.reward_model)
    if args.reward_model_name_or_path:
        rewards = [args.reward_model_class]
        models = [f"{args.reward_model_class}={args.reward_model_name_or_path}"]
    bare = [p for p in args.reward_placement if "=" not in p]
    named = [p for p in args.reward_placement if "=" in p]
    if len(bare) > 1:
        raise ArgumentError(f"--reward_placement is given {len(bare)} times without NAME=")
    default = bare[0] if bare else "shard"
    if default not in ENGINE_PLACEMENT_CHOICES:
        raise ArgumentError(
            f"--reward_placement {default}: choose one of {', '.join(ENGINE_PLACEMENT_CHOICES)} (or NAME=PLACEMENT)"
        )
    placed = {p.partition("=")[0] for p in named}
    return [
        dataclasses.replace(spec, placement=default) if spec.has_model and spec.name not in placed else spec
        for spec in parse_reward_specs(rewards, models, named)
    ]


class RewardTrainer:
    """setup() -> train() -> save()."""

    def __init__(self, args: RewardSettings):
        self.args = args
        self.global_step = 0
        self.rewards: list[float] = []
        self.rewards_per_rank: list[list[float]] = []
        self.trained_steps = 0
        self.nonfinite = NonFiniteUpdates(args.max_nonfinite_steps)  # the updates skipped as non-finite
        self.stop_signals = StopSignals(parse_signals(args.save_on_signal))  # noted while train() runs

    def setup(self) -> None:
        from accelerate.utils import set_seed
        from diffusers import AutoencoderKL, DDIMScheduler
        from transformers import CLIPTextModel, CLIPTokenizer

        args = self.args
        quiet_library_notices()
        validate_common_args(args)
        check_positive(args, ("num_inference_steps", "reward_micro_batch_size"))
        if args.return_freed_memory:
            return_large_frees_to_os()
        self.source = resolve_model_folder(args.pretrained_model_name_or_path)
        check_output_dir(args.output_dir, self.source)
        pipeline_components(self.source)
        if detect_family(self.source) is not SD:
            raise ArgumentError(
                f"{args.pretrained_model_name_or_path} is not a StableDiffusionPipeline; this script samples "
                "with SD 1.x/2.x pipelines only"
            )
        self.accelerator = acc = accelerator_from_args(args)
        launch = {
            "deepspeed_active": acc.state.deepspeed_plugin is not None,
            "on_cpu": acc.device.type == "cpu",
        }
        validate_launch(args, **launch)
        specs = reward_specs(args)
        for spec in specs:
            if spec.has_model:
                validate_launch(args, **launch, placements={"reward": spec.placement})
        clear_interrupted_writes(args.output_dir)
        # A seed per rank: each rank samples its own prompts and initial latents (the same
        # seed everywhere would make N-1 ranks repeat rank 0's samples).
        set_seed(args.seed, device_specific=True)
        self.dtype = weight_dtype(acc)
        self.tokenizer = CLIPTokenizer.from_pretrained(self.source, subfolder="tokenizer")
        self.scheduler = DDIMScheduler.from_pretrained(self.source, subfolder="scheduler")
        self.scheduler.set_timesteps(args.num_inference_steps)
        unet = load_trainable_denoiser(acc, self.source)
        self.text_encoder = load_frozen_component(
            acc, self.source, "text_encoder", args.text_encoder_placement, CLIPTextModel
        )
        self.vae = load_frozen_component(acc, self.source, "vae", args.vae_placement, AutoencoderKL)
        self.reward = load_rewards(
            specs,
            acc,
            micro_batch_size=args.reward_micro_batch_size,
            differentiable=True,
            normalize=args.reward_normalize,
        )
        self.reward_names = [spec.name for spec in specs]
        self.rewards_by_spec: dict[str, list[float]] = {name: [] for name in self.reward_names}
        # the UNet as the job's trained part: its engine, AdamW, clipping at --max_grad_norm, EMA
        set_micro_batch_size(acc, args.train_batch_size)
        self.part, _ = prepare_first_part(
            acc, "unet", unet, adamw(unet, args), max_grad_norm=args.max_grad_norm, ema=bool(args.use_ema)
        )
        self.unet, self.ema = self.part.engine, self.part.ema
        if acc.is_main_process and args.report_to != "none":
            acc.init_trackers(args.tracker_project_name, args.scalars())
        resumed = resume_training(
            acc, args.output_dir, args.resume_from_checkpoint, ema=self.ema, fallback=args.resume_fallback
        )
        if resumed is not None:
            path, state = resumed
            self.global_step, self.rewards = state["global_step"], state["rewards"]
            self.rewards_per_rank = state.get("rewards_per_rank", [])
            self.rewards_by_spec = state.get("rewards_by_spec", self.rewards_by_spec)
            if int(state["world_size"]) != acc.num_processes:
                log_rank_zero(
                    f"{path} was written by {state['world_size']} processes; resharded for {acc.num_processes}"
                )
            log_rank_zero(f"resumed from {path} at step {self.global_step}")

    def _sample_images(self, prompts: list[str]) -> torch.Tensor:
        """DDIM samples decoded to images in [0, 1] (as the reward registry takes them, and as
        the pipeline's postprocessing clamps them); gradients only through the last K UNet calls."""
        args, device = self.args, self.accelerator.device
        ids = self.tokenizer(
            prompts,
            max_length=self.tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(device)
        with torch.no_grad():
            states = self.text_encoder(ids, return_dict=False)[0].to(self.dtype)
        size = args.resolution // (2 ** (len(self.vae.config.block_out_channels) - 1))
        channels = self.part.module.config.in_channels
        latents = torch.randn(len(prompts), channels, size, size, device=device)
        timesteps = self.scheduler.timesteps
        for i, t in enumerate(timesteps):
            with torch.set_grad_enabled(i >= len(timesteps) - args.truncated_backprop_steps):
                eps = self.unet(latents.to(self.dtype), t.expand(len(prompts)).to(device), states).sample
                latents = self.scheduler.step(eps.float(), t, latents).prev_sample
        decoded = self.vae.decode((latents / self.vae.config.scaling_factor).to(self.dtype)).sample.float()
        return (decoded / 2 + 0.5).clamp(0, 1)

    def _loss(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's loss ``-mean(reward)`` of samples of ``prompts``, with the rewards (the
        weighted total per sample, and each ``--reward``'s). Collective (the reward models)."""
        rewards, by_spec = self.reward(self._sample_images(prompts), prompts)
        return -rewards.mean(), rewards, by_spec

    def train(self) -> None:
        """Steps until ``--max_train_steps``: sample, score, step, log, checkpoint. Collective.
        A ``step N reward X`` line per step: on a terminal only into
        ``OUTPUT_DIR/<logging_dir>/train.log`` beside a progress bar, elsewhere printed as well.

        A step whose loss is not finite on some rank is skipped on every rank (weights,
        optimizer and EMA unchanged; ``--max_nonfinite_steps``); a ``--save_on_signal`` signal
        on any rank ends the job after its step, with that step's checkpoint (``Preempted``)."""
        args, acc = self.args, self.accelerator
        log_file = step_log_path(args.output_dir, args.logging_dir)
        with (
            StepOutput(
                args.max_train_steps,
                initial=self.global_step,
                log_file=log_file,
                bar=acc.is_local_main_process,
            ) as steps,
            self.stop_signals,
        ):
            while self.global_step < args.max_train_steps:
                self._step(steps)

    def _step(self, steps: StepOutput) -> None:
        """One step: sample and score this rank's prompts, backward, the optimizer and EMA steps
        (skipped on every rank when a rank's loss is not finite), log, checkpoint; then stop
        when a rank got a signal. Collective."""
        args, acc = self.args, self.accelerator
        pick = torch.randint(0, len(args.prompts), (args.train_batch_size,))  # CPU: indexes a list
        prompts = [args.prompts[i] for i in pick]
        loss, rewards, by_spec = self._loss(prompts)
        acc.backward(loss)
        applied = step_part(self.part, acc, sync=True)
        # one gather per step: each rank's loss, whether it got a stop signal, and its rewards
        signalled = loss.new_tensor([self.stop_signals.flag()], dtype=torch.float32)
        row = torch.cat([loss.detach().float().reshape(1), signalled, rewards.detach().float()])
        rows = acc.gather(row.reshape(1, -1))  # (ranks, 2 + samples per rank)
        if self.nonfinite.record(applied, self.global_step + 1, nonfinite_ranks(rows[:, 0].tolist())):
            if self.ema is not None:
                self.ema.step()
        stop = bool(rows[:, 1].any())
        self.global_step += 1
        self.trained_steps += 1
        per_rank = rows[:, 2:].mean(dim=1)
        mean_reward = per_rank.mean().item()
        self.rewards.append(mean_reward)
        self.rewards_per_rank.append(per_rank.tolist())
        for name in self.reward_names:  # every rank, in the same order: gathers
            self.rewards_by_spec[name].append(acc.gather(by_spec[name].detach()).mean().item())
        acc.log({"reward": mean_reward, "loss": loss.item()}, step=self.global_step)
        steps.step(f"step {self.global_step} reward {mean_reward:.6f}", reward=f"{mean_reward:.4f}")
        if self.global_step % args.checkpointing_steps == 0:
            self._checkpoint()
        if stop:  # every rank: the step is done, then its checkpoint is published and the job stops
            self.stop_signals.checkpoint_and_stop(
                "at step", self.global_step, args.checkpointing_steps, self._checkpoint
            )

    def _checkpoint(self) -> None:
        """The step's checkpoint, its rewards with it. Collective."""
        args = self.args
        save_training_checkpoint(
            self.accelerator,
            args.output_dir,
            self.global_step,
            {
                "epoch": 0,
                "batches_in_epoch": 0,
                "rewards": self.rewards,
                "rewards_per_rank": self.rewards_per_rank,
                "rewards_by_spec": self.rewards_by_spec,
            },
            ema=self.ema,
            total_limit=args.checkpoints_total_limit,
        )

    def save(self) -> None:
        """The final pipeline, rewards.json and the reward curve (every rank); kept as is when
        resuming a finished run trained no step and the folder is complete."""
        args = self.args
        if self.trained_steps == 0 and (Path(args.output_dir) / "model_index.json").exists():
            log_rank_zero(f"pipeline: {Path(args.output_dir).resolve()} (already complete)")
            finish_trackers(self.accelerator)
            return
        call = {
            "num_inference_steps": args.num_inference_steps,
            **SD.size_kwargs(args.resolution, args.resolution),
        }
        card = model_card(args.pretrained_model_name_or_path, "rewards: " + ", ".join(self.reward_names),
                          args.scalars(), args.prompts, SD.pipeline_class, SD.task, call)  # fmt: skip
        save_final_pipeline(self.source, args.output_dir, self.unet, ema=self.ema, readme=card)
        if self.accelerator.is_main_process:
            out = Path(args.output_dir)
            (out / "rewards.json").write_text(
                json.dumps({"mean": self.rewards, "per_rank": self.rewards_per_rank, **self.rewards_by_spec})
            )
            title = "mean reward per step"
            if self.rewards:
                title += f": {self.rewards[0]:.3f} -> {self.rewards[-1]:.3f} (max {max(self.rewards):.3f})"
            plot_curve(self.rewards, out / "rewards.png", title, axes=CurveAxes(ylabel="mean reward of the step's samples"),
                       smooth=min(10, max(1, len(self.rewards) // 5)))  # fmt: skip
            k, first, last = first_last_means(self.rewards)
            log_rank_zero(f"mean reward: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
            log_outputs([
                ("pipeline", out, "StableDiffusionPipeline.from_pretrained"),
                ("rewards", out / "rewards.json", "the mean per step, per rank and per reward"),
                ("reward curve", out / "rewards.png"),
                *run_logs(args),
            ])  # fmt: skip
        finish_trackers(self.accelerator)
