"""Masked loss (``--mask_column``): the mask follows its image's crop and flip, is averaged down
to the latents, and weighs each element's squared error; checked against a hand computation
for the DDPM and the flow-matching losses, on 4-D and 5-D latents."""

import random

import pytest
import torch

from diffusers_zero3.data.images import transform_image_with_crop, transform_mask
from diffusers_zero3.families.objectives import (
    DDPMDraw,
    diffusion_loss,
    flow_matching_loss,
    latent_loss_weights,
    weighted_sample_means,
)

pytestmark = pytest.mark.unit


def _gradient_image(width: int, height: int):
    """A grayscale ramp whose every pixel differs from its mirror: a crop or flip that goes
    wrong shows."""
    from PIL import Image

    image = Image.new("L", (width, height))
    image.putdata([(7 * x + 3 * y) % 256 for y in range(height) for x in range(width)])
    return image


@pytest.mark.parametrize("size", [32, (24, 40), (40, 24)], ids=["square", "landscape", "portrait"])
def test_the_mask_takes_its_images_crop_and_flip(size):
    image = _gradient_image(70, 50)
    flips = set()
    for seed in range(6):
        pixels, crop = transform_image_with_crop(image.convert("RGB"), size, False, True, random.Random(seed))
        mask = transform_mask(image, crop)
        # the mask is the image's own channel, mapped from [-1, 1] back to [0, 1]: the same
        # resize, crop and flip (to the 8-bit rounding of the two conversions)
        assert mask.shape == (1, *pixels.shape[1:])
        torch.testing.assert_close(mask[0], (pixels[0] + 1) / 2, atol=1 / 255 + 1e-6, rtol=0)
        flips.add(crop.flipped)
    assert flips == {True, False}  # both orientations were checked
    # a mask of another size is resized to its image first
    assert transform_mask(image.resize((35, 25)), crop).shape == mask.shape


def test_latent_weights_average_the_pixels_each_latent_encodes():
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :, :4] = 1.0
    mask[..., 0, 4] = 1.0  # one pixel of the 16 under the right latents of the top row
    latents = torch.zeros(1, 4, 2, 2, device="meta")  # a second device: the weights follow the latents
    weights = latent_loss_weights(mask, latents)
    assert weights.device.type == "meta" and weights.shape == (1, 1, 2, 2)
    expected = torch.tensor([[[[1.0, 1 / 16], [1.0, 0.0]]]])
    torch.testing.assert_close(latent_loss_weights(mask, torch.zeros(1, 4, 2, 2)), expected)
    video = latent_loss_weights(mask, torch.zeros(1, 4, 3, 2, 2))
    assert video.shape == (1, 1, 1, 2, 2)


def test_weighted_means_against_a_hand_computation():
    error = torch.arange(16, dtype=torch.float32).reshape(2, 2, 2, 2)
    weights = torch.tensor([[[[1.0, 0.0], [0.5, 0.0]]], [[[0.0, 0.0], [0.0, 0.0]]]])
    got = weighted_sample_means(error, weights)
    # sample 0: channels 0 and 1 at (0,0) weight 1 and (1,0) weight 0.5
    e = error[0]
    hand = (e[0, 0, 0] + e[1, 0, 0] + 0.5 * (e[0, 1, 0] + e[1, 1, 0])) / (2 * 1.5)
    assert got[0].item() == pytest.approx(hand.item())
    assert got[1].item() == 0.0  # all weights zero: no loss, no division by zero
    torch.testing.assert_close(
        weighted_sample_means(error, torch.ones(2, 1, 2, 2)), error.mean(dim=(1, 2, 3))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flow_matching_and_ddpm_losses_weigh_each_element(dtype):
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    latents = torch.randn(2, 4, 4, 4, dtype=dtype)
    noise = torch.randn(2, 4, 4, 4, dtype=dtype)
    mask = (torch.rand(2, 1, 4, 4) > 0.5).float()

    def predict(noisy, t):  # a denoiser that predicts zero: the error is the target itself
        return torch.zeros_like(noisy)

    flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    masked = flow_matching_loss(predict, flow, latents, noise, reduction="none", loss_weights=mask)
    target = (noise - latents).float() ** 2
    hand = (target * mask).sum(dim=(1, 2, 3)) / (mask.sum(dim=(1, 2, 3)) * 4)
    torch.testing.assert_close(masked, hand)
    plain = flow_matching_loss(predict, flow, latents, noise, reduction="none")
    ones = flow_matching_loss(
        predict, flow, latents, noise, reduction="none", loss_weights=torch.ones_like(mask)
    )
    torch.testing.assert_close(ones, plain)
    assert not torch.allclose(masked, plain)  # the mask changed the loss

    ddpm = DDPMScheduler(num_train_timesteps=1000)
    t = torch.tensor([10, 500])
    masked = diffusion_loss(predict, ddpm, latents, DDPMDraw(noise, t), loss_weights=mask)
    hand = ((noise.float() ** 2 * mask).sum(dim=(1, 2, 3)) / (mask.sum(dim=(1, 2, 3)) * 4)).mean()
    torch.testing.assert_close(masked, hand)
    assert diffusion_loss(
        predict, ddpm, latents, DDPMDraw(noise, t), loss_weights=torch.ones_like(mask)
    ).item() == pytest.approx(diffusion_loss(predict, ddpm, latents, DDPMDraw(noise, t)).item(), rel=1e-6)


def test_the_dataset_gives_each_row_its_mask():
    import io

    import datasets

    def png(image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    ramp = _gradient_image(48, 32)
    features = datasets.Features(
        {"image": datasets.Image(), "mask": datasets.Image(), "text": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [png(ramp.convert("RGB"))], "mask": [png(ramp)], "text": ["a ramp"]}, features=features
    )
    from diffusers_zero3.data.images import ImageCaptionDataset
    from diffusers_zero3.data.pixels import RowsToPixels

    dataset = ImageCaptionDataset(
        ds,
        RowsToPixels(
            resolution=16,
            random_flip=True,
            seed=4,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 2, dtype=torch.long)},
            mask_column="mask",
        ),
    )
    item = dataset[0]
    assert item["loss_mask"].shape == (1, 16, 16)
    torch.testing.assert_close(
        item["loss_mask"][0], (item["pixel_values"][0] + 1) / 2, atol=1 / 255 + 1e-6, rtol=0
    )


def test_a_clip_mask_goes_to_the_latents_as_a_causal_video_vae_compresses_time():
    """(n, 1, F, H, W) -> (n, 1, f, h, w): the first frame alone, then each group of (F-1)/(f-1)."""
    mask = torch.zeros(1, 1, 5, 4, 4)
    mask[:, :, 0, :2, :2] = 1.0  # the first frame: its top-left quarter
    mask[:, :, 3, :, :2] = 1.0  # one of frames 1-4: its left half
    weights = latent_loss_weights(mask, torch.zeros(1, 16, 2, 2, 2))
    assert weights.shape == (1, 1, 2, 2, 2)
    expected = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]], [[0.25, 0.0], [0.25, 0.0]]]]).unsqueeze(0)
    torch.testing.assert_close(weights, expected)
    assert latent_loss_weights(mask[:, :, :1], torch.zeros(1, 16, 1, 2, 2)).shape == (1, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="does not map onto"):
        latent_loss_weights(torch.zeros(1, 1, 4, 4, 4), torch.zeros(1, 16, 3, 2, 2))


def test_a_video_rows_mask_clip_takes_its_clips_frames_crop_and_flip(tmp_path):
    import json

    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.data.video import (
        ClipSampling,
        VideoCaptionDataset,
        load_video_caption_dataset,
        write_shapes_videos,
    )

    folder = write_shapes_videos(tmp_path / "clips", num_clips=2, frames=7, sizes=[(48, 32)])
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps({**r, "mask": r["file_name"]}) + "\n" for r in rows)
    )
    clips = VideoCaptionDataset(
        load_video_caption_dataset(folder),
        RowsToPixels(
            resolution=24,
            random_flip=True,
            seed=1,
            mask_column="mask",
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 2, dtype=torch.long)},
        ),
        ClipSampling(5, random_start=True),
    )
    for i in range(2):
        item = clips[i]
        rgb = (item["pixel_values"] + 1) * 127.5  # (3, F, H, W) back to 0-255
        luma = (rgb[0] * 299 + rgb[1] * 587 + rgb[2] * 114) / 1000 / 255  # PIL's "L"
        assert item["loss_mask"].shape == (1, 5, 24, 24)
        torch.testing.assert_close(item["loss_mask"][0], luma, atol=2 / 255, rtol=0)
