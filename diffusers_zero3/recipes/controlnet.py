"""ControlNet under ZeRO-3 (``scripts/train_controlnet.py``): the ControlNet is the trained model
(a ZeRO-3 engine), initialised from the denoiser's weights without a whole copy of it on any
rank or loaded from ``--controlnet_model_name_or_path``, and the denoiser is frozen and placed
like every frozen model (``--unet_placement replicate|shard|offload``). SD 1.x/2.x and SDXL
(the same ``time_ids`` and pooled embeddings reach both models), with diffusers'
``train_controlnet*.py`` flags and objective; the output ``OUTPUT_DIR/controlnet`` loads with
``ControlNetModel.from_pretrained`` and works in the family's ControlNet pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from pathlib import Path
from typing import ClassVar

import torch

from ..args import ENGINE_PLACEMENT_CHOICES, flag, placement_flag, redefault
from ..data.images import DataError, transform_image
from ..errors import ArgumentError
from ..placement.frozen import load_frozen_component
from ..placement.frozen_inputs import component_folder
from ..runtime.distributed import is_main_process, log_rank_zero
from ..training.data import TrainingData
from ..training.report import log_run_outputs, log_validation_images
from .text_to_image import TextToImageTrainer
from .text_to_image_settings import TextToImageSettings

# the UNet's modules a new ControlNet copies (ControlNetModel.from_unet)
FROM_UNET = (
    "conv_in.",
    "time_embedding.",
    "class_embedding.",
    "add_embedding.",
    "down_blocks.",
    "mid_block.",
)
# the ControlNet's output convolutions, zero at the start (diffusers' zero_module)
ZERO_INIT = ("controlnet_down_blocks.", "controlnet_mid_block.", "controlnet_cond_embedding.conv_out.")


_T2I = TextToImageSettings


@dataclasses.dataclass
class ControlNetSettings(TextToImageSettings):
    """The settings of ``scripts/train_controlnet.py``: the text-to-image settings with
    diffusers' ControlNet flags and defaults (its scripts validate every
    ``--validation_steps``, 100, only)."""

    DESCRIPTION: ClassVar[str] = (
        "ControlNet training under DeepSpeed ZeRO-3, beside a frozen (placeable) denoiser."
    )
    GROUP: ClassVar[str | None] = "ControlNet"
    learning_rate: float = redefault(_T2I, "learning_rate", 5e-6)
    train_batch_size: int = redefault(_T2I, "train_batch_size", 4)
    num_train_epochs: int = redefault(_T2I, "num_train_epochs", 1)
    output_dir: str = redefault(_T2I, "output_dir", "controlnet-model")
    validation_steps: int | None = redefault(_T2I, "validation_steps", 100)
    validation_epochs: int | None = redefault(_T2I, "validation_epochs", None)
    controlnet_model_name_or_path: str | None = flag(
        None, "A ControlNet to go on training; default: a new one from the denoiser's weights."
    )
    conditioning_image_column: str = flag("conditioning_image", "The conditioning images' column.")
    validation_image: list[str] | None = flag(None, "Conditioning images of --validation_prompt.")
    validation_prompt: list[str] | None = flag(None, "Validation prompts (one per image, or one).")
    num_validation_images: int = flag(1, "Images per validation prompt.")
    unet_placement: str = placement_flag(
        "replicate",
        "Where the frozen denoiser lives (shard: a ZeRO-3 inference engine, 1/N per rank).",
        choices=ENGINE_PLACEMENT_CHOICES,
    )
    crops_coords_top_left_h: int | None = flag(
        None,
        "Coordinate for (the height) to be included in the crop coordinate embeddings needed by SDXL UNet: "
        "the same for every image (diffusers' ControlNet SDXL script uses 0); default: each image's own crop.",
    )
    crops_coords_top_left_w: int | None = flag(
        None,
        "Coordinate for (the width) to be included in the crop coordinate embeddings needed by SDXL UNet: "
        "the same for every image (diffusers' ControlNet SDXL script uses 0); default: each image's own crop.",
    )

    def merge_validation_prompt(self) -> None:
        """Nothing: ``resolve`` pairs ``--validation_prompt`` with ``--validation_image``."""

    def resolve(self) -> None:
        """Check the ControlNet flags (raise ``ArgumentError``) and pair the validation prompts
        with their conditioning images."""
        super().resolve()
        if self.rank is not None:
            raise ArgumentError(
                "train_controlnet.py trains the whole ControlNet (--rank is for LoRA scripts)"
            )
        if self.validation_prompts is not None:
            raise ArgumentError("train_controlnet.py takes --validation_prompt and --validation_image")
        if (self.validation_prompt is None) != (self.validation_image is None):
            raise ArgumentError("--validation_prompt and --validation_image go together")
        if self.validation_prompt is not None:
            prompts, images = self.validation_prompt, self.validation_image
            if len(prompts) == 1 and len(images) > 1:
                prompts = prompts * len(images)
            elif len(images) == 1 and len(prompts) > 1:
                images = images * len(prompts)
            if len(prompts) != len(images):
                raise ArgumentError(
                    "give one --validation_image, one --validation_prompt, or as many of each"
                )
            for path in images:
                if not os.path.isfile(path):
                    raise ArgumentError(f"--validation_image {path!r} is not a file")
            self.validation_prompt, self.validation_image = prompts, images
            self.validation_prompts = prompts  # turns validation on in the loop
        if self.random_flip:
            raise ArgumentError("--random_flip does not apply: a conditioning image keeps its orientation")
        for name in ("crops_coords_top_left_h", "crops_coords_top_left_w"):
            if vars(self)[name] is not None and vars(self)[name] < 0:
                raise ArgumentError(f"--{name} must not be negative, got {vars(self)[name]}")


def conditioning_pixels(image, resolution: int) -> torch.Tensor:
    """A conditioning image as diffusers' ControlNet scripts feed it: RGB, shorter side to
    ``resolution``, centre crop, in [0, 1] (CHW float)."""
    return (transform_image(image.convert("RGB"), resolution, True, False, random.Random(0)) + 1.0) / 2.0


class ControlNetPairs(torch.utils.data.Dataset):
    """Items of an ``ImageCaptionDataset`` (centre crops) with the row's conditioning image."""

    def __init__(self, images, dataset, column: str, resolution: int):
        self.images, self.dataset, self.column, self.resolution = images, dataset, column, resolution
        self.skipped_rows = images.skipped_rows

    def __len__(self) -> int:
        return len(self.images)

    def set_epoch(self, epoch: int) -> None:
        self.images.set_epoch(epoch)

    def __getitem__(self, index: int) -> dict:
        item = self.images[index]
        value = self.dataset[int(item["index"])][self.column]
        if isinstance(value, str):
            from PIL import Image

            value = Image.open(value)
        item["conditioning_pixel_values"] = conditioning_pixels(value, self.resolution)
        return item


def new_controlnet_from_unet(
    accelerator, unet_folder: str | os.PathLike, conditioning_embedding_out_channels, seed: int = 0
):
    """A ControlNet initialised from the UNet in ``unet_folder`` as ``ControlNetModel.from_unet``
    does: the UNet's input convolution, time (and added) embeddings, down blocks and middle
    block; its output convolutions zero. Under ZeRO-3 it is built partitioned and each rank reads
    its partitions of those tensors from the UNet's files: no rank holds the UNet, nor the
    ControlNet, whole. The weights it does not copy (the conditioning embedding's) are drawn
    from ``seed`` on every rank, the same with or without ZeRO-3. Collective under ZeRO-3:
    every rank."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    from ..runtime.zero3 import is_zero3_enabled, is_zero3_param, zero3_init_disabled
    from ..state.pretrained import load_partitions_from

    if not is_zero3_enabled():
        with zero3_init_disabled():
            unet = UNet2DConditionModel.from_pretrained(unet_folder)
            torch.manual_seed(seed)
            return ControlNetModel.from_unet(
                unet, conditioning_embedding_out_channels=conditioning_embedding_out_channels
            )
    from ..runtime.distributed import init_distributed_if_needed
    from ..state.pretrained import build_partitioned, zero_init_config

    with zero3_init_disabled(), torch.device("meta"):  # the config from_unet makes, from the UNet's
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_folder))
        config = dict(
            ControlNetModel.from_unet(
                unet,
                load_weights_from_unet=False,
                conditioning_embedding_out_channels=conditioning_embedding_out_channels,
            ).config
        )
    init_distributed_if_needed()
    torch.manual_seed(seed)
    controlnet = build_partitioned(
        lambda: ControlNetModel.from_config(config), zero_init_config(None, accelerator)
    )
    copied = load_partitions_from(controlnet, unet_folder, FROM_UNET)
    with torch.no_grad():
        # zero_module() in ControlNetModel.__init__ zeroed empty placeholders: the partitions
        # of these weights are random until zeroed here (every rank zeroes its own)
        for name, p in controlnet.named_parameters():
            if name.startswith(ZERO_INIT):
                (p.ds_tensor if is_zero3_param(p) else p).data.zero_()
    log_rank_zero(f"ControlNet from the UNet's weights: {len(copied)} tensors copied, partitioned")
    return controlnet


class ControlNetTrainer(TextToImageTrainer):
    """The text-to-image trainer with a ControlNet trained beside the frozen denoiser."""

    args: ControlNetSettings

    cacheable_data = True  # the latents and text are fixed per row; conditioning images are read live
    image_caption_rows = False  # its own data: no aspect-ratio buckets or loss masks

    def load_trained_models(self) -> dict[str, torch.nn.Module]:
        """The ControlNet the loop trains (``--controlnet_model_name_or_path``'s, or a new one
        with the UNet's weights), partitioned under ZeRO-3, and the frozen UNet its residuals
        steer (``self.unet``, at ``--unet_placement``). Every rank."""
        from diffusers import ControlNetModel

        from ..runtime.zero3 import is_zero3_enabled, zero3_init_disabled
        from ..state.pretrained import load_pretrained_zero3, resolve_model_folder

        args = self.args
        if self.family.controlnet_pipeline_class is None:
            raise ArgumentError(f"train_controlnet.py trains ControlNets of SD and SDXL pipelines, not of a "
                                f"{self.family.pipeline_class}")  # fmt: skip
        if self._fixed_crop() is not None and not self.family.uses_time_ids:
            raise ArgumentError(
                f"--crops_coords_top_left_h/_w set SDXL's crop micro-conditioning; a {self.family.pipeline_class} "
                "has none"
            )
        if args.controlnet_model_name_or_path:
            folder = resolve_model_folder(
                args.controlnet_model_name_or_path, None, args.revision, args.cache_dir
            )
            if is_zero3_enabled():
                model = load_pretrained_zero3(ControlNetModel, folder, accelerator=self.accelerator)
            else:
                with zero3_init_disabled():
                    model = ControlNetModel.from_pretrained(folder)
        else:
            unet_folder = component_folder(self.source, self.component_sources, "unet")
            model = new_controlnet_from_unet(
                self.accelerator, unet_folder, self._conditioning_channels(), seed=args.seed or 0
            )
        if is_zero3_enabled():
            from ..runtime.ds_config import fill_auto_bucket_sizes

            plugin = self.accelerator.state.deepspeed_plugin
            if plugin is not None:
                fill_auto_bucket_sizes(plugin.deepspeed_config, model)
        model.train()
        model.requires_grad_(True)
        if args.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        folder = component_folder(self.source, self.component_sources, "unet")
        self.unet = load_frozen_component(
            self.accelerator, folder.parent, folder.name, self.args.unet_placement, self.family.denoiser_cls(), self.args.variant,
            label="unet",
        )  # fmt: skip
        log_rank_zero(self.unet.describe())
        return {"controlnet": model}  # the trained model of the loop: the ControlNet

    def _fixed_crop(self) -> tuple[int, int] | None:
        """``(top, left)`` of ``--crops_coords_top_left_h/_w`` (one given: the other 0, diffusers'
        default), the crop corner SDXL's time ids then give for every image; None: each
        image's own crop."""
        top, left = self.args.crops_coords_top_left_h, self.args.crops_coords_top_left_w
        if top is None and left is None:
            return None
        return (top or 0, left or 0)

    def _conditioning_channels(self) -> tuple[int, ...]:
        """The conditioning embedding's channels: one stage per factor 2 of the VAE's
        downsampling, as diffusers' (16, 32, 96, 256) for SD's 8x."""
        return (16, 32, 96, 256)[: len(self.job.vae_config()["block_out_channels"])]

    def load_data(self) -> TrainingData:
        """The image-caption rows, each with its ``--conditioning_image_column`` image. Every
        rank."""
        data = super().load_data()
        column = self.args.conditioning_image_column
        if column not in data.dataset.column_names:
            raise DataError(
                f"--conditioning_image_column {column!r} is not a dataset column (columns: "
                f"{', '.join(data.dataset.column_names)})"
            )
        data.rows = ControlNetPairs(data.rows, data.dataset, column, self.args.resolution)
        return data

    def _controlled_predict(self, controlnet, cond: dict, image: torch.Tensor):
        """The denoiser's prediction with the ControlNet's residuals: the ControlNet sees the
        noisy latents, the timesteps, the conditioning and the conditioning image; SDXL's pooled
        embeddings and time ids reach both models."""
        extra = self.family.unet_kwargs(cond)
        dtype = self.frozen.dtype

        def predict(noisy, timesteps):
            down, mid = controlnet(
                noisy, timesteps, encoder_hidden_states=cond["encoder_hidden_states"],
                controlnet_cond=image.to(noisy.device, dtype), return_dict=False, **extra,
            )  # fmt: skip
            return self.family.predict(
                self.unet, noisy, timesteps, cond,
                down_block_additional_residuals=[d.to(dtype) for d in down],
                mid_block_additional_residual=mid.to(dtype),
            )  # fmt: skip

        return predict

    def loss(self, batch: dict) -> torch.Tensor:
        """The family's objective on the frozen UNet's prediction steered by the ControlNet's
        residuals (``--crops_coords_top_left_h/_w``: SDXL's crop ids fixed)."""
        from ..families.objectives import sample_generators

        generators = sample_generators(self.args.seed or 0, self.epoch, batch["index"])
        latents, cond, _ = self.frozen(batch, self.accelerator.device, generators)
        crop = self._fixed_crop()
        if crop is not None:  # SDXL's time ids: (original h, w, crop top, left, target h, w)
            cond["time_ids"] = cond["time_ids"].clone()
            cond["time_ids"][:, 2:4] = torch.tensor(
                crop, dtype=cond["time_ids"].dtype, device=cond["time_ids"].device
            )
        objective = self.family.objective(self.noise_scheduler, self.objective_settings)
        predict = self._controlled_predict(self.denoiser, cond, batch["conditioning_pixel_values"])
        return objective.loss(predict, latents, generators)

    def _pipeline(self, modules: dict):
        import diffusers

        kwargs = {"unet": self.unet.module, "controlnet": getattr(self.denoiser, "module", self.denoiser),
                  "vae": modules["vae"],
                  "scheduler": self.family.sampling_scheduler(self.noise_scheduler),
                  **dict(self.family.pipeline_kwargs)}  # fmt: skip
        for spec in self.family.text_encoders:
            kwargs[spec.name] = modules[spec.name]
            kwargs[spec.tokenizer] = self.tokenizers[spec.name]
        return getattr(diffusers, self.family.controlnet_pipeline_class)(**kwargs)

    def validate(self) -> None:
        """For each validation prompt: its conditioning image beside the samples the ControlNet
        pipeline makes from it (every rank; rank 0 writes the grid)."""
        from PIL import Image

        from ..state.pipeline_io import image_grid

        args, acc = self.args, self.accelerator
        if not args.validation_prompt:
            return
        ema = self.ema.averaged_weights() if self.ema is not None else contextlib.nullcontext()
        rows = []
        with self.frozen.validation_modules(acc) as modules, ema:
            pipeline = self._pipeline(modules)
            pipeline.set_progress_bar_config(disable=True)
            controlnet = pipeline.controlnet
            was_training = controlnet.training
            controlnet.eval()
            lower = self.frozen.dtype in (torch.bfloat16, torch.float16)
            device = acc.device
            autocast = (
                torch.autocast(device.type, dtype=self.frozen.dtype) if lower else contextlib.nullcontext()
            )
            with torch.no_grad(), autocast:
                for i, (prompt, path) in enumerate(zip(args.validation_prompt, args.validation_image)):
                    image = Image.open(path).convert("RGB").resize((args.resolution, args.resolution))
                    samples = [
                        pipeline(
                            prompt=prompt, image=image, num_inference_steps=args.num_validation_inference_steps,
                            height=args.resolution, width=args.resolution,
                            generator=torch.Generator(device=device).manual_seed((args.seed or 0) + i * 100 + k),
                        ).images[0]
                        for k in range(args.num_validation_images)
                    ]  # fmt: skip
                    rows.append([image, *samples])
            controlnet.train(was_training)
        if is_main_process():
            folder = Path(args.output_dir) / "validation"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"step-{self.global_step:06d}.png"
            image_grid([img for row in rows for img in row], cols=len(rows[0])).save(path)
            log_validation_images(acc.trackers, [img for row in rows for img in row[1:]], self.global_step)
            log_rank_zero(f"validation images: {path} (each row: the conditioning image, then the samples)")

    def save(self) -> None:
        """``OUTPUT_DIR/controlnet`` (the EMA average when used), streamed from the partitions
        into a staging folder and moved into place. Every rank."""
        from ..state.folders import collective_publish
        from ..state.pretrained import save_pretrained_zero3
        from ..training.job import finish_trackers

        args = self.args
        final = Path(args.output_dir) / "controlnet"
        if self.trained_steps == 0 and (final / "config.json").exists():
            log_rank_zero(f"output: {final} (already complete)")
            finish_trackers(self.accelerator)
            return
        with collective_publish(final) as staging:
            if self.ema is not None:
                self.ema.save_pretrained(staging)
            else:
                save_pretrained_zero3(self.denoiser, staging)
        finish_trackers(self.accelerator)
        note = (
            f"ControlNetModel.from_pretrained; {self.family.controlnet_pipeline_class} with the base pipeline"
        )
        log_run_outputs(("ControlNet", final, note), args, self.family.video)
