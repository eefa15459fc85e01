"""The ``hpsv2`` built-in (``rewards.hps``) against the authors' computation run by real
open_clip code: a tiny open_clip model of ViT-H-14's structure, saved in the published
checkpoint format, scored by ``img_score.py``'s formula (``encode_image`` / ``encode_text`` with
``normalize=True``, the diagonal of ``image_features @ text_features.T``), and by us through
``load_rewards``.

open_clip imports torchvision at module level, which cannot run here: it is imported inside
``reference_imports.torchvision_stub()`` and everything the tests need from it (models,
tokenizer, vocabulary) is built there. The reference's image transform is HPSv2's
``preprocess_val`` (``light_augmentation=True``: ``ToTensor``, ``ResizeMaxSize``, ``Normalize``;
hpsv2/src/open_clip/transform.py) written out with the torch calls torchvision's tensor
functions make: the geometry (which edge, ``round``, where the padding goes, no clamp) is
checked against the authors' code; the bicubic kernel is torch's in both.
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.reference_imports import torchvision_stub
from tests.test_reward_registry import PROMPTS, _as_tensor, _pil, _smooth_images, _uint8_images

TINY = "HPS-tiny-ViT-H-14"
# ViT-H-14's structure (open_clip model_configs/ViT-H-14.json: the text width equal to
# embed_dim, so its projection is square, the vision width not, heads from head_width), tiny;
# the published tokenizer's vocabulary and context.
TINY_VIT_H14 = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 48, "head_width": 12, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
}
CHECKPOINT = "HPS_v2.1_compressed.pt"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip constants.OPENAI_DATASET_MEAN
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
TOKENIZER_PROMPTS = [
    *PROMPTS,
    "A  Photo of   the Eiffel-Tower, at night!! (4k, HDR) 'don't' & co.",
    " ".join(["a very long prompt about many colourful shapes"] * 12),  # past 77 tokens: truncated
]
# A bf16 run scores HPSv2 in fp32 (issue 50: in bf16 its cosines rounded in steps of ~0.002,
# the size of the differences within a prompt's group): the authors' fp32 scores within fp32
# bounds whatever the run's dtype. Measured here: 1.5e-7.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _tiny_clip_config():
    """The ``CLIPConfig`` of ``TINY_VIT_H14`` (MLP ratio 4, exact GELU, as ViT-H-14)."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                         max_position_embeddings=77, vocab_size=49408, hidden_act="gelu", projection_dim=32),
        vision_config=dict(hidden_size=48, intermediate_size=192, num_attention_heads=4, num_hidden_layers=2,
                           image_size=32, patch_size=8, hidden_act="gelu", projection_dim=32),
        projection_dim=32,
    )  # fmt: skip


def _write_bpe_tokenizer(folder, bytes_to_unicode, bpe_path) -> None:
    """A ``CLIPTokenizer`` of open_clip's BPE file, its vocabulary built as ``SimpleTokenizer``
    builds it (bytes, bytes + ``</w>``, the first 48894 merges, then start / end of text, which
    transformers names ``<|startoftext|>`` / ``<|endoftext|>``)."""
    from transformers import CLIPTokenizer

    merges = gzip.open(bpe_path).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(merge.split()) for merge in merges]
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=77)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    """The tiny model's folder (published checkpoint, config.json, tokenizer files) and what the
    reference needs from open_clip: the model as ``img_score.py`` loads it, the tokenizer of
    ``get_tokenizer('ViT-H-14')``, and ViT-H-14 itself on the meta device."""
    folder = tmp_path_factory.mktemp("hpsv2")
    configs = tmp_path_factory.mktemp("open_clip_configs")
    (configs / f"{TINY}.json").write_text(json.dumps(TINY_VIT_H14))
    with torchvision_stub():
        import open_clip
        from open_clip.tokenizer import bytes_to_unicode, default_bpe

        open_clip.add_model_config(configs)
        torch.manual_seed(0)
        trained = open_clip.create_model(TINY)
        state = {k: v.half() for k, v in trained.state_dict().items()}  # a "compressed" file, fp16
        torch.save({"state_dict": state}, folder / CHECKPOINT)
        # img_score.py: create_model_and_transforms('ViT-H-14', ...), then
        # model.load_state_dict(torch.load(cp)['state_dict']), eval()
        reference = open_clip.create_model(TINY)
        reference.load_state_dict(torch.load(folder / CHECKPOINT, weights_only=True)["state_dict"])
        tokenizer = open_clip.get_tokenizer("ViT-H-14")
        with torch.device("meta"):  # built there, not built on the CPU and moved
            vit_h14 = open_clip.create_model("ViT-H-14", device="meta")
        vit_h14_cfg = open_clip.get_model_config("ViT-H-14")
        _write_bpe_tokenizer(folder, bytes_to_unicode, default_bpe())
    _tiny_clip_config().save_pretrained(folder)
    return SimpleNamespace(
        folder=folder,
        reference=reference.eval(),
        tokenizer=tokenizer,
        vit_h14=vit_h14,
        vit_h14_cfg=vit_h14_cfg,
    )


def _preprocess_val(image, size: int) -> torch.Tensor:
    """HPSv2's ``preprocess_val`` of one PIL image: ``_convert_to_rgb_or_rgba``, ``ToTensor``,
    ``ResizeMaxSize(size, fill=0)`` (torchvision's tensor ``resize``: ``interpolate`` bicubic,
    ``antialias=True``, a float result unclamped; ``pad([left, top, right, bottom])``),
    ``Normalize`` with OpenAI's mean / std."""
    x = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float().div(255)
    height, width = x.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        x = torch.nn.functional.interpolate(
            x[None], size=new_size, mode="bicubic", align_corners=False, antialias=True
        )[0]
        pad_h, pad_w = size - new_size[0], size - new_size[1]
        left, top, right, bottom = pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2
        x = torch.nn.functional.pad(x, (left, right, top, bottom), value=0.0)
    mean, std = torch.tensor(OPENAI_MEAN)[:, None, None], torch.tensor(OPENAI_STD)[:, None, None]
    return (x - mean) / std


def _reference(hps, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """img_score.py: ``image_features @ text_features.T`` of the normalised features, its diagonal."""
    model = copy.deepcopy(hps.reference).to(dtype)
    size = TINY_VIT_H14["vision_cfg"]["image_size"]
    pixels = torch.stack([_preprocess_val(im, size) for im in _pil(images)]).to(dtype)
    with torch.no_grad():
        image_features = model.encode_image(pixels, normalize=True)
        text_features = model.encode_text(hps.tokenizer(prompts), normalize=True)
        scores = torch.diagonal(image_features @ text_features.T)
    return scores.float()


def _rewards(folder, dtype):
    """Our ``hpsv2``: the spec parsed, the model loaded replicated (``ParallelReward``, one
    process), as ``test_reward_registry._ours``."""
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    specs = parse_reward_specs(["hpsv2"], [f"hpsv2={folder}"], ["hpsv2=replicate"])
    rewards = load_rewards(specs, None, dtype)
    assert rewards.rewards["hpsv2"].model.placement == "replicate"
    return rewards


def _score(rewards, images: torch.Tensor, prompts) -> torch.Tensor:
    total, scores = rewards(images, prompts)
    torch.testing.assert_close(total, scores["hpsv2"])
    return scores["hpsv2"]


# every case of ResizeMaxSize: none (the model's size), shrink either edge longer (padding on
# both sides, odd), enlarge
IMAGE_SIZES = ((32, 32), (40, 26), (24, 44), (20, 16))


@pytest.mark.unit
def test_our_tokenizer_is_open_clips_simple_tokenizer(hps):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(hps.folder)(
        TOKENIZER_PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    theirs = hps.tokenizer(TOKENIZER_PROMPTS)  # [N, 77], zero-padded
    for i, prompt in enumerate(TOKENIZER_PROMPTS):
        ids = ours["input_ids"][i][ours["attention_mask"][i].bool()]
        assert ids.tolist() == theirs[i][theirs[i] != 0].tolist(), prompt
    assert theirs[-1, -1] == 49407 and ours["input_ids"].shape[1] == 77  # the long one truncated


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hpsv2_is_the_authors_computation(hps, dtype):
    rewards = _rewards(hps.folder, dtype)
    errors = []
    for seed, (h, w) in enumerate(IMAGE_SIZES):
        make = _uint8_images if (h, w) == (32, 32) else _smooth_images  # no resize: any pixels
        images = make(8 if (h, w) == (32, 32) else 4, h, w, seed=seed)
        prompts = (PROMPTS * 2)[: len(images)]
        ours = _score(rewards, _as_tensor(images), prompts)
        expected = _reference(hps, images, prompts, torch.float32)
        torch.testing.assert_close(ours, expected, **TOLERANCE, msg=f"{h}x{w}")
        errors.append((ours - expected).abs().max().item())
        assert ours.std() > 0.05, ours  # a control: the scores differ between samples
    print(f"max |ours - reference| {dtype}: {max(errors):.3g}")


@pytest.mark.unit
def test_a_wrong_conversion_or_transform_would_differ(hps):
    """Controls: what the fp32 bound would catch. An untransposed text projection (square in
    ViT-H-14, so it would load silently), and the shortest-edge resize with centre crop of
    open_clip's usual eval transform instead of HPSv2's padding."""
    from diffusers_zero3.rewards.hps import HPSv2
    from diffusers_zero3.rewards.images import ClipImageConfig, clip_pixel_values

    images = _smooth_images(4, 40, 26, seed=1)
    expected = _reference(hps, images, PROMPTS, torch.float32)
    reward = HPSv2.from_pretrained(hps.folder)
    with torch.no_grad():
        right = reward(reward.preprocess(_as_tensor(images), PROMPTS))
        torch.testing.assert_close(right, expected, rtol=1e-5, atol=1e-5)
        projection = reward.clip.text_projection.weight
        projection.copy_(projection.t().clone())
        untransposed = reward(reward.preprocess(_as_tensor(images), PROMPTS))
        projection.copy_(projection.t().clone())
        cropped = clip_pixel_values(_as_tensor(images), ClipImageConfig(shortest_edge=32, crop=(32, 32)))
        ids = reward.tokenizer(PROMPTS, padding=True, return_tensors="pt")
        crop = reward.clip(**ids, pixel_values=cropped)
        crop_scores = (crop.image_embeds * crop.text_embeds).sum(-1)
    print(
        f"untransposed {(untransposed - expected).abs().max():.3g}, cropped {(crop_scores - expected).abs().max():.3g}"
    )
    assert (untransposed - expected).abs().max() > 1e-2
    assert (crop_scores - expected).abs().max() > 1e-3


@pytest.mark.unit
def test_vit_h14_config_is_open_clips_and_its_checkpoint_converts(hps):
    """``vit_h14_config()`` has open_clip's ViT-H-14 sizes, and ViT-H-14's state dict (on the
    meta device: its names and shapes) converts to exactly a CLIPModel of that config."""
    from diffusers_zero3.rewards.hps import (
        check_clip_state_dict,
        open_clip_to_clip_state_dict,
        vit_h14_config,
    )

    config, cfg = vit_h14_config(), hps.vit_h14_cfg
    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    v, t = config.vision_config, config.text_config
    assert config.projection_dim == v.projection_dim == t.projection_dim == cfg["embed_dim"]
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.patch_size, v.image_size) == (
        vision["width"], vision["layers"], vision["width"] // vision["head_width"], vision["patch_size"],
        vision["image_size"],
    )  # fmt: skip
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.max_position_embeddings) == (
        text["width"], text["layers"], text["heads"], text["context_length"],
    )  # fmt: skip
    assert t.vocab_size == text["vocab_size"]
    assert (v.intermediate_size, t.intermediate_size) == (4 * v.hidden_size, 4 * t.hidden_size)
    assert v.hidden_act == t.hidden_act == "gelu" and not cfg.get("quick_gelu", False)
    check_clip_state_dict(open_clip_to_clip_state_dict(hps.vit_h14.state_dict()), config)


@pytest.mark.unit
def test_a_bad_folder_is_a_value_error_naming_what_is_missing(hps, tmp_path):
    from diffusers_zero3.rewards.hps import HPSv2

    state = torch.load(hps.folder / CHECKPOINT, weights_only=True)["state_dict"]

    def folder(name: str, content, files=(CHECKPOINT,), config: bool = True):
        """A folder of ``content`` saved as each of ``files``, with the tiny config.json."""
        path = tmp_path / name
        path.mkdir()
        for f in files:
            torch.save(content, path / f)
        if config:
            shutil.copy(hps.folder / "config.json", path / "config.json")
        return path

    cases = [
        (folder("empty", None, files=()), "must hold one checkpoint, HPS_v2_compressed.pt or"),
        (folder("both", {"state_dict": state}, files=(CHECKPOINT, "HPS_v2_compressed.pt")), "it holds both"),
        (folder("bare", state), "has no 'state_dict'"),
        (
            folder("ddp", {"state_dict": {f"module.{k}": v for k, v in state.items()}}),
            "do not convert to a CLIPModel (not open_clip's OpenAI-layout CLIP): module.",
        ),
        (
            folder("no_ln", {"state_dict": {k: v for k, v in state.items() if k != "ln_final.bias"}}),
            "missing text_model.final_layer_norm.bias",
        ),
        (  # no config.json: ViT-H-14's, which the tiny weights do not fit
            folder("no_config", {"state_dict": state}, config=False),
            "does not fit the CLIP config (ViT-H-14 unless the folder has a config.json):"
            " missing text_model.encoder.layers.10.",
        ),
    ]
    for path, message in cases:
        with pytest.raises(ValueError) as e:
            HPSv2.from_pretrained(path)
        assert message in str(e.value), (path.name, str(e.value))
