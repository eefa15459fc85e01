"""Diffusion-DPO (Wallace et al., 2023): preference pairs and the loss of diffusers'
``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``.

A pair is a caption with a preferred and a rejected image (Pick-a-Pic's columns ``jpg_0``,
``jpg_1`` as encoded bytes, ``label_0`` = 1 when ``jpg_0`` is preferred, ``caption``; ties,
``label_0`` = 0.5, are dropped as upstream does). A batch of B pairs is 2B images, the
preferred ones first; the trained and the reference denoisers each see both halves with the
same noise and timesteps, and the loss compares how much better the trained one got on the
preferred image than on the rejected one, relative to the reference.

``DPOTrainer`` (with its ``DPOSettings``) is the trainer behind
``scripts/train_dpo.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..args import ENGINE_PLACEMENT_CHOICES, flag, redefault
from ..data.images import DataError, load_image_caption_dataset, transform_image_with_crop
from ..errors import ArgumentError
from ..families.objectives import diffusion_target, sample_generators, sample_noise, sample_timesteps
from ..placement.cache import model_fingerprint
from ..placement.frozen import load_frozen_component
from ..runtime.distributed import log_rank_zero
from ..runtime.ds_config import weight_dtype
from ..state.pipeline_io import CurveAxes, plot_curve
from ..training.data import TrainingData, select_rows
from ..training.schedule import first_last_means
from .text_to_image import TextToImageTrainer
from .text_to_image_settings import TextToImageSettings

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
PICKAPIC_COLUMNS = ("jpg_0", "jpg_1", "label_0", "caption")


def dpo_loss(
    model_losses: torch.Tensor, ref_losses: torch.Tensor, beta: float, loss_type: str = "sigmoid"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Diffusion-DPO loss of 2B per-sample denoising errors (preferred half first), and
    its metrics.

    ``inside = -beta / 2 * ((model_w - model_l) - (ref_w - ref_l))``; ``sigmoid``:
    ``-logsigmoid(inside)``, ``hinge``: ``relu(1 - inside)``, ``ipo``:
    ``(inside - 1 / (2 beta))^2``, each a mean over the pairs, as diffusers' script. Metrics
    (detached): ``implicit_acc`` (the fraction of pairs with ``inside > 0``), the implicit
    rewards ``reward_chosen`` / ``reward_rejected`` (``-beta / 2 * (model - ref)`` of each
    half) and their difference ``reward_margin``, and the raw ``model_mse`` / ``ref_mse``.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    model_w, model_l = model_losses.chunk(2)
    ref_w, ref_l = ref_losses.chunk(2)
    inside = -0.5 * beta * ((model_w - model_l) - (ref_w - ref_l))
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(inside).mean()
    elif loss_type == "hinge":
        loss = torch.relu(1 - inside).mean()
    else:
        loss = ((inside - 1 / (2 * beta)) ** 2).mean()
    reward_w = (-0.5 * beta * (model_w - ref_w)).detach()
    reward_l = (-0.5 * beta * (model_l - ref_l)).detach()
    metrics = {
        "implicit_acc": (inside.detach() > 0).float().mean(),
        "reward_chosen": reward_w.mean(),
        "reward_rejected": reward_l.mean(),
        "reward_margin": (reward_w - reward_l).mean(),
        "model_mse": model_losses.detach().mean(),
        "ref_mse": ref_losses.detach().mean(),
    }
    return loss, metrics


def check_preference_columns(dataset) -> None:
    """Raise ``DataError`` naming the Pick-a-Pic columns the dataset lacks."""
    missing = [c for c in PICKAPIC_COLUMNS if c not in dataset.column_names]
    if missing:
        raise DataError(
            f"the preference dataset lacks the column(s) {', '.join(missing)} (it has "
            f"{', '.join(dataset.column_names)}); expected Pick-a-Pic's {', '.join(PICKAPIC_COLUMNS)}"
        )


def drop_ties(dataset):
    """The pairs with a preference (``label_0`` 0 or 1); ties (0.5) are dropped, as upstream.
    Raises ``DataError`` for any other label."""
    labels = set(dataset["label_0"])
    odd = sorted(v for v in labels if v not in (0, 0.5, 1))
    if odd:
        raise DataError(f"label_0 must be 0, 0.5 (a tie) or 1, got {odd[:5]}")
    return dataset.filter(lambda label: label != 0.5, input_columns="label_0")


def _open(value):
    from PIL import Image

    if isinstance(value, dict):  # datasets' Image feature without decoding
        value = value.get("bytes")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value)).convert("RGB")
    return value.convert("RGB")


class PreferencePairs(torch.utils.data.Dataset):
    """Rows of a Pick-a-Pic-style dataset as ``{"pixel_values": (2, 3, H, W), "original_size":
    (2, 2), "crop_top_left": (2, 2), <token ids>, "index"}``, the preferred image first.

    Both images of a pair get the same crop and flip, drawn per row and epoch
    (``set_epoch``), so that a resumed run sees the same pixels. ``tokenize`` maps captions to
    a dict of token-id tensors (a family's ``tokenize``).
    """

    def __init__(
        self,
        dataset,
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
        resolution: int,
        center_crop: bool = False,
        random_flip: bool = False,
        seed: int = 0,
    ):
        self.dataset = dataset
        self._tokenize = tokenize
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip
        self.seed, self.epoch = seed, 0
        self.skipped_rows: set[int] = set()  # the training loop reports it (pairs never skip)

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        pair = (row["jpg_0"], row["jpg_1"]) if row["label_0"] == 1 else (row["jpg_1"], row["jpg_0"])
        pixels, sizes, crops = [], [], []
        for image in pair:
            rng = random.Random(f"{self.seed}-{self.epoch}-{index}")  # the same draw for both
            p, crop = transform_image_with_crop(
                _open(image), self.resolution, self.center_crop, self.random_flip, rng
            )
            pixels.append(p)
            sizes.append(crop.original_size)
            crops.append(crop.crop_top_left)
        item = {k: v[0] for k, v in self._tokenize([row["caption"]]).items()}
        item.update(
            index=index,
            pixel_values=torch.stack(pixels),
            # CPU: data-loader side, like the pixels; accelerate's prepared loader moves the batch
            original_size=torch.tensor(sizes),
            crop_top_left=torch.tensor(crops),  # CPU: as original_size
        )
        return item


def collate_pairs(examples: list[dict]) -> dict:
    """A batch of B pairs: ``pixel_values``, ``original_size`` and ``crop_top_left`` hold 2B
    rows (the B preferred images, then the B rejected ones); token ids and ``index`` hold B."""
    batch = {}
    for key in examples[0]:
        if key in ("pixel_values", "original_size", "crop_top_left"):
            batch[key] = torch.cat([torch.stack([e[key][k] for e in examples]) for k in (0, 1)])
        elif key == "index":
            batch[key] = torch.tensor([e[key] for e in examples])  # CPU: collate, on the loader's side
        else:
            batch[key] = torch.stack([e[key] for e in examples])
    return batch


# -------------------------------------------------------------------------- the trainer


_T2I = TextToImageSettings


@dataclasses.dataclass
class DPOSettings(TextToImageSettings):
    """The settings of ``scripts/train_dpo.py``: the text-to-image settings plus diffusers'
    Diffusion-DPO flags (``train_diffusion_dpo.py``) and defaults."""

    DESCRIPTION: ClassVar[str] = "Diffusion-DPO under DeepSpeed ZeRO-3 (SD 1.x/2.x, SDXL)."
    GROUP: ClassVar[str | None] = "Diffusion-DPO (diffusers' train_diffusion_dpo.py)"
    rank: int | None = redefault(_T2I, "rank", 4)
    caption_column: str = redefault(_T2I, "caption_column", "caption")
    image_column: str = redefault(_T2I, "image_column", "jpg_0")
    output_dir: str = redefault(_T2I, "output_dir", "diffusion-dpo")
    beta_dpo: float = flag(2500, "DPO's KL penalty beta (upstream: 2500; 5000 for SDXL).")
    loss_type: str = flag("sigmoid", "DPO loss.", choices=DPO_LOSS_TYPES)
    reference_placement: str = flag(
        "replicate",
        "Where the reference denoiser of --rank 0 lives (shard: a ZeRO-3 inference engine).",
        choices=ENGINE_PLACEMENT_CHOICES,
    )
    dataset_split_name: str = flag("train", "The split of --dataset_name to train on.")

    def resolve(self) -> None:
        """Check the Diffusion-DPO flags (raise ``ArgumentError``); ``--rank 0`` trains the
        whole denoiser (``rank`` becomes None) beside a reference engine."""
        super().resolve()
        if self.rank == 0:
            self.rank = None
        elif self.reference_placement != "replicate":
            raise ArgumentError(
                f"--reference_placement {self.reference_placement} applies to --rank 0: with LoRA (--rank "
                f"{self.rank}) the reference is the base with the adapters disabled"
            )
        if self.beta_dpo <= 0:
            raise ArgumentError(f"--beta_dpo must be positive, got {self.beta_dpo}")


class DPOTrainer(TextToImageTrainer):
    """The text-to-image trainer with preference pairs, a reference and the DPO loss."""

    args: DPOSettings

    cacheable_data = False  # two images per row: the VAE runs live (auto never picks cache)
    image_caption_rows = False  # its own data: no aspect-ratio buckets or loss masks

    def setup(self) -> None:
        if self.args.vae_placement == "cache":
            raise ArgumentError(
                "--vae_placement cache does not apply to preference pairs: use replicate or shard"
            )
        super().setup()

    def load_trained_models(self) -> dict[str, torch.nn.Module]:
        """The denoiser, as text-to-image trains it, and its frozen reference (``self.reference``
        at ``--reference_placement``; under LoRA none: the base with the adapters disabled).
        Every rank."""
        if self.family.flow_matching:
            raise ArgumentError(
                f"train_dpo.py trains SD 1.x/2.x and SDXL pipelines, not {self.family.pipeline_class}"
            )
        trained = super().load_trained_models()
        if self.args.rank is not None:
            self.reference = None  # the base with the adapters disabled
            log_rank_zero("reference: the base denoiser with the LoRA adapters disabled")
            return trained
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
        return trained

    def load_data(self) -> TrainingData:
        """The preference pairs of ``--dataset_name`` (ties dropped), both images of a pair
        transformed alike. Every rank."""
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
        ds = select_rows(ds, args, self.job.data_processes)
        pairs = PreferencePairs(
            ds,
            lambda captions: self.family.tokenize(self.tokenizers, captions),
            args.resolution,
            args.center_crop,
            args.random_flip,
            seed=args.seed or 0,
        )
        return TrainingData(
            pairs, ds, "jpg_0", "caption", args.train_batch_size, self.job.data_processes, seed=args.seed or 0,
            collate_fn=collate_pairs,
        )  # fmt: skip

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

    def loss(self, batch: dict) -> torch.Tensor:
        """Diffusion-DPO's loss of a micro-batch of pairs: both images noised alike, the policy's
        and the reference's errors compared (``dpo_loss``; its metrics logged)."""
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
            pairs, n_steps, latents.device, self.objective_settings.timestep_weights, generators
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
                    axes=CurveAxes(ylabel="implicit accuracy (share of pairs)", y_range=(0.0, 1.0)),
                    reference=(0.5, "chance (0.5)"),
                    smooth=10,
                )
                log_rank_zero(f"implicit accuracy curve: {path}")
        if self.reference is not None:
            after = model_fingerprint(self.reference.module)  # collective
            log_rank_zero(f"reference fingerprint after training: {after}")
            if after != self.reference_fingerprint:
                raise RuntimeError("the reference denoiser changed during training")
        return losses
