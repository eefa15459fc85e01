"""Diffusion-DPO (Wallace et al., 2023): preference pairs and the loss of diffusers'
``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``.

A pair is a caption with a preferred and a rejected image (Pick-a-Pic's columns ``jpg_0``,
``jpg_1`` as encoded bytes, ``label_0`` = 1 when ``jpg_0`` is preferred, ``caption``; ties,
``label_0`` = 0.5, are dropped as upstream does). A batch of B pairs is 2B images, the
preferred ones first; the trained and the reference denoisers each see both halves with the
same noise and timesteps, and the loss compares how much better the trained one got on the
preferred image than on the rejected one, relative to the reference.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..data.images import DataError, transform_image_with_crop

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
