#!/usr/bin/env python
"""Diffusion-DPO (Wallace et al., 2023) for SD 1.x/2.x and SDXL under DeepSpeed ZeRO-3, with
the reference denoiser as a ZeRO-3 inference engine.

The flags of diffusers' ``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``
(and its SDXL variant) under the same names: ``--beta_dpo``, ``--loss_type``
(sigmoid/hinge/ipo), ``--rank`` (default 4), ``--dataset_name`` (a hub id or a local folder
of parquet files with Pick-a-Pic's ``jpg_0``, ``jpg_1``, ``label_0``, ``caption``; ties are
dropped), ``--dataset_split_name``, plus every flag of ``scripts/train_text_to_image.py``
(placements of the frozen models, EMA, checkpoints, validation, bad-input errors).

* ``--rank N`` (default 4, as upstream) trains LoRA adapters; the reference is the base
  denoiser with the adapters disabled (no second model), and the output is
  ``pytorch_lora_weights.safetensors``.
* ``--rank 0`` trains the whole denoiser; the reference is a separate frozen copy placed by
  ``--reference_placement`` (``replicate``, ``shard``: a ZeRO-3 inference engine holding 1/N
  per rank, or ``offload``). The output is a pipeline folder.

    accelerate launch --config_file configs/accelerate_zero3.yaml --num_processes 8 \\
        scripts/train_dpo.py --pretrained_model_name_or_path PIPE --dataset_name PAIRS \\
        --rank 0 --reference_placement shard --beta_dpo 2500 --output_dir out

Implicit accuracy, the implicit rewards of the chosen and rejected images and their margin,
and both denoisers' errors are logged every step (log and TensorBoard).
"""
# ruff: noqa: E402 (the imports below come after the huge-pages call)

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from diffusers_zero3 import use_huge_pages_for_host_tensors

use_huge_pages_for_host_tensors()  # first: torch reads it at the process's first tensor, and imports make tensors

import torch

from diffusers_zero3.args import ArgumentError, text_to_image_parser
from diffusers_zero3.data.images import load_image_caption_dataset
from diffusers_zero3.placement.cache import model_fingerprint
from diffusers_zero3.recipes.dpo import (
    DPO_LOSS_TYPES,
    PreferencePairs,
    check_preference_columns,
    collate_pairs,
    dpo_loss,
    drop_ties,
)
from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
from diffusers_zero3.runtime.distributed import log_rank_zero
from diffusers_zero3.runtime.ds_config import weight_dtype
from diffusers_zero3.state.pipeline_io import plot_curve
from diffusers_zero3.training.objectives import (
    diffusion_target,
    sample_generators,
    sample_noise,
    sample_timesteps,
)
from diffusers_zero3.training.recipe import load_frozen_component, run_trainer
from diffusers_zero3.training.schedule import first_last_means


def dpo_parser():
    """The text-to-image flags plus diffusers' Diffusion-DPO ones."""
    p = text_to_image_parser()
    p.description = "Diffusion-DPO under DeepSpeed ZeRO-3 (SD 1.x/2.x, SDXL)."
    g = p.add_argument_group("Diffusion-DPO (diffusers' train_diffusion_dpo.py)")
    g.add_argument(
        "--beta_dpo", type=float, default=2500, help="DPO's KL penalty beta (upstream: 2500; 5000 for SDXL)."
    )
    g.add_argument("--loss_type", type=str, default="sigmoid", choices=DPO_LOSS_TYPES, help="DPO loss.")
    g.add_argument(
        "--reference_placement",
        type=str,
        default="replicate",
        choices=("replicate", "shard", "offload"),
        help="Where the reference denoiser of --rank 0 lives (shard: a ZeRO-3 inference engine).",
    )
    g.add_argument(
        "--dataset_split_name", type=str, default="train", help="The split of --dataset_name to train on."
    )
    p.set_defaults(rank=4, caption_column="caption", image_column="jpg_0", output_dir="diffusion-dpo")
    return p


def parse_args(argv: list[str] | None = None):
    args = dpo_parser().parse_args(argv)
    if args.non_ema_revision is None:
        args.non_ema_revision = args.revision
    if args.rank == 0:  # the whole denoiser, beside a reference engine
        args.rank = None
    elif args.reference_placement != "replicate":
        raise ArgumentError(
            f"--reference_placement {args.reference_placement} applies to --rank 0: with LoRA (--rank "
            f"{args.rank}) the reference is the base with the adapters disabled"
        )
    if args.beta_dpo <= 0:
        raise ArgumentError(f"--beta_dpo must be positive, got {args.beta_dpo}")
    return args


class DPOTrainer(TextToImageTrainer):
    """The text-to-image trainer with preference pairs, a reference and the DPO loss."""

    cacheable_data = False  # two images per row: the VAE runs live (auto never picks cache)

    def setup(self) -> None:
        if self.args.vae_placement == "cache":
            raise ArgumentError(
                "--vae_placement cache does not apply to preference pairs: use replicate or shard"
            )
        super().setup()

    def _load_models(self) -> None:
        if self.family.flow_matching:
            raise ArgumentError(
                f"train_dpo.py trains SD 1.x/2.x and SDXL pipelines, not {self.family.pipeline_class}"
            )
        super()._load_models()
        if self.args.rank is not None:
            self.reference = None  # the base with the adapters disabled
            log_rank_zero("reference: the base denoiser with the LoRA adapters disabled")
            return
        self.reference = load_frozen_component(
            self.accelerator,
            self.source,
            self.family.denoiser,
            self.args.reference_placement,
            self.family.denoiser_cls(),
            self.args.variant,
            dtype=weight_dtype(self.accelerator),
        )
        log_rank_zero("reference " + self.reference.describe())
        self.reference_fingerprint = model_fingerprint(self.reference.module)  # collective
        log_rank_zero(f"reference fingerprint before training: {self.reference_fingerprint}")

    def _load_data(self) -> None:
        args = self.args
        if args.train_data_dir is not None:
            raise ArgumentError(
                "train_dpo.py reads preference pairs from --dataset_name (parquet or hub), not --train_data_dir"
            )
        ds = load_image_caption_dataset(
            args.dataset_name, args.dataset_config_name, None, args.cache_dir, split=args.dataset_split_name
        )
        check_preference_columns(ds)
        before = len(ds)
        ds = drop_ties(ds)
        log_rank_zero(f"{len(ds)} preference pairs ({before - len(ds)} ties dropped)")
        self.hf_dataset = ds = self._select_rows(ds)
        self.image_column, self.caption_column = "jpg_0", "caption"
        self.train_dataset = PreferencePairs(
            ds,
            lambda captions: self.family.tokenize(self.tokenizers, captions),
            args.resolution,
            args.center_crop,
            args.random_flip,
            seed=args.seed or 0,
        )
        self.collate_fn = collate_pairs

    @contextlib.contextmanager
    def _reference_context(self):
        """The reference's forward: the separate frozen model as is, or the trained LoRA
        denoiser with its adapters disabled for the block."""
        if self.reference is not None:
            yield
            return
        module = getattr(self.denoiser, "module", self.denoiser)
        module.disable_adapters()
        try:
            yield
        finally:
            module.enable_adapters()

    def _loss(self, batch: dict) -> torch.Tensor:
        args = self.args
        # one generator per pair (seed, epoch, row): the same draws whichever rank trains it
        generators = sample_generators(args.seed or 0, self.epoch, batch["index"])
        latents, cond, _ = self.frozen(batch, self.accelerator.device)  # 2B latents, B conditions
        # Each caption conditions both images of its pair; SDXL's time_ids are per image already.
        cond = {k: v if k == "time_ids" else torch.cat([v, v]) for k, v in cond.items()}
        pairs = latents.shape[0] // 2
        noise = sample_noise(latents[:pairs], args.noise_offset, generators).repeat(2, 1, 1, 1)  # both images
        n_steps = self.noise_scheduler.config.num_train_timesteps
        timesteps = sample_timesteps(
            pairs, n_steps, latents.device, self.timestep_weights, generators
        ).repeat(2)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        target = diffusion_target(self.noise_scheduler, latents, noise, timesteps)
        with torch.no_grad(), self._reference_context():  # every rank, once per micro-batch
            reference = self.reference if self.reference is not None else self.denoiser
            ref_pred = self.family.predict(reference, noisy, timesteps, cond)
            ref_losses = (ref_pred.float() - target.float()).pow(2).mean(dim=[1, 2, 3])
        pred = self.family.predict(self.denoiser, noisy, timesteps, cond)
        model_losses = (pred.float() - target.float()).pow(2).mean(dim=[1, 2, 3])
        loss, self.batch_metrics = dpo_loss(model_losses, ref_losses, args.beta_dpo, args.loss_type)
        return loss

    def train(self) -> list[float]:
        losses = super().train()
        if self.metric_history:
            accuracy = [m["implicit_acc"] for m in self.metric_history]
            k, first, last = first_last_means(accuracy)
            log_rank_zero(
                f"implicit accuracy: mean of the first {k} steps {first:.3f} -> of the last {k} {last:.3f}"
            )
            if self.accelerator.is_main_process:
                Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
                path = plot_curve(
                    accuracy,
                    Path(self.args.output_dir) / "implicit_accuracy.png",
                    f"Diffusion-DPO implicit accuracy per step ({self.args.loss_type}, beta {self.args.beta_dpo:g})",
                    y_range=(0.0, 1.0),
                    reference=0.5,
                    smooth=10,
                    ylabel="implicit accuracy (share of pairs)",
                    reference_label="chance (0.5)",
                )
                log_rank_zero(f"implicit accuracy curve: {path}")
        if self.reference is not None:
            after = model_fingerprint(self.reference.module)  # collective
            log_rank_zero(f"reference fingerprint after training: {after}")
            if after != self.reference_fingerprint:
                raise RuntimeError("the reference denoiser changed during training")
        return losses


def main(argv: list[str] | None = None) -> int:
    return run_trainer(lambda: DPOTrainer(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
