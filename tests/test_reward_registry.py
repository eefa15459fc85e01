"""The reward registry (``diffusers_zero3.rewards``): the command-line specs and each of their
errors, the checks of every reward's output, the weighted sum, each built-in against its
authors' computation written here with plain transformers calls on tiny models, and PickScore
sharded on 2 real ranks against its replica."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.common import rank_slice
from tests.distributed_harness import run_on_ranks

PROMPTS = ["a red circle", "a blue square", "a photo of a green circle", "the yellow shape"]
SELF = "tests.test_reward_registry"

# A bf16 run scores the built-ins in fp32 (issue 50: BuiltinReward.dtype), so their scores equal
# the authors' fp32 computation within fp32 bounds whatever the run's dtype. The vlm judge runs
# in the run's dtype: ours and the reference then round differently in places (the pixels are
# cast from float32 values that differ in the last bits), a few bf16 steps of its scores.
FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
BF16_TOLERANCES = {"vlm": dict(rtol=0, atol=2e-4)}


def _tolerance(name: str, dtype: torch.dtype) -> dict:
    return BF16_TOLERANCES.get(name, FP32_TOLERANCE) if dtype == torch.bfloat16 else FP32_TOLERANCE


# ------------------------------------------------------------------ plain function rewards


def brightness(images, prompts):
    return images.mean(dim=(1, 2, 3))


def prompt_length(images, prompts):
    return torch.tensor([float(len(p)) for p in prompts], device=images.device)


def one_short(images, prompts):
    return images.mean(dim=(1, 2, 3))[:-1]


def nan_on_second(images, prompts):
    out = images.mean(dim=(1, 2, 3)).clone()
    out[1:2] = float("nan")
    return out


def inf_on_first(images, prompts):
    out = images.mean(dim=(1, 2, 3)).clone()
    out[:1] = float("inf")
    return out


def raises(images, prompts):
    raise RuntimeError("the scoring service is down")


NOT_CALLABLE = 3


def motion(videos, prompts):
    """A video reward: the mean absolute change between a clip's consecutive frames."""
    assert videos.ndim == 5, videos.shape
    return (videos[:, 1:] - videos[:, :-1]).abs().mean(dim=(1, 2, 3, 4))


motion.takes_videos = True


def brightness_and_colour(images, prompts, metadata):
    """An image reward with metadata: brightness, plus 1 where the row names a colour."""
    return images.mean(dim=(1, 2, 3)) + torch.tensor([float("color" in m) for m in metadata])


def _uint8_images(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``n`` random 8-bit RGB images ``[n, H, W, 3]``: what a PIL processor sees exactly."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, height, width, 3), dtype=np.uint8)


def _smooth_images(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Like ``_uint8_images`` but of low spatial frequency, as photographs and generated images
    are: resizing white noise, Pillow's two 8-bit passes clip the overshoot of the first one
    (up to 17 levels apart from a float resize here), which no real image shows."""
    small = torch.rand(n, 3, 5, 5, generator=torch.Generator().manual_seed(seed))
    big = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear", align_corners=True)
    return (big * 255).round().byte().permute(0, 2, 3, 1).numpy()


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    """The same images as the rewards take them: float ``[B, 3, H, W]`` in ``[0, 1]``."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


def _pil(images: np.ndarray) -> list:
    from PIL import Image

    return [Image.fromarray(im) for im in images]


# ------------------------------------------------------------------ specs


@pytest.mark.unit
def test_specs_parse_names_weights_models_and_placements():
    from diffusers_zero3.rewards import RewardSpec, parse_reward_specs

    specs = parse_reward_specs(
        ["pickscore=2", "aesthetic=0.5", f"{SELF}:brightness", f"{SELF}:prompt_length=-1e-2"],
        ["pickscore=yuvalkirstain/PickScore_v1", "aesthetic=/models/aesthetic"],
        ["aesthetic=replicate"],
    )
    assert specs == [
        RewardSpec("pickscore", 2.0, "yuvalkirstain/PickScore_v1", "shard"),
        RewardSpec("aesthetic", 0.5, "/models/aesthetic", "replicate"),
        RewardSpec(f"{SELF}:brightness", 1.0),
        RewardSpec(f"{SELF}:prompt_length", -0.01),
    ]
    assert specs[2].function is brightness and not specs[2].is_builtin and specs[0].is_builtin
    assert parse_reward_specs([], [], []) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "rewards, models, placements, message",
    [
        (
            ["pickscor"],
            [],
            [],
            "--reward pickscor: unknown built-in reward; choose one of aesthetic, clip_score, "
            "clip_score_100, hpsv2, hpsv3, imagereward, pairwise_vlm, pickscore, pickscore_logit, unifiedreward,"
            " unifiedreward_video, vlm,"
            " or give"
            " a function as module:function",
        ),
        (
            ["no_such_module_xyz:fn"],
            [],
            [],
            "--reward no_such_module_xyz:fn: module 'no_such_module_xyz' does not"
            " import (ModuleNotFoundError: No module named 'no_such_module_xyz')",
        ),
        ([f"{SELF}:missing"], [], [], f"--reward {SELF}:missing: module '{SELF}' has no 'missing'"),
        (
            [f"{SELF}:NOT_CALLABLE"],
            [],
            [],
            f"--reward {SELF}:NOT_CALLABLE: 'NOT_CALLABLE' is a int, not a function",
        ),
        (
            ["pickscore=heavy"],
            ["pickscore=p"],
            [],
            "--reward 'pickscore=heavy': the weight 'heavy' is not a number",
        ),
        (
            ["pickscore=nan"],
            ["pickscore=p"],
            [],
            "--reward 'pickscore=nan': the weight 'nan' is not a number",
        ),
        (["pickscore="], ["pickscore=p"], [], "--reward 'pickscore=': the weight '' is not a number"),
        (
            ["pickscore"],
            ["pickscore=p", "aesthetic=a"],
            [],
            "--reward_model aesthetic: no such reward given with --reward (given: pickscore)",
        ),
        (
            ["pickscore"],
            ["pickscore=p"],
            ["vlm=shard"],
            "--reward_placement vlm: no such reward given with --reward (given: pickscore)",
        ),
        (
            ["pickscore"],
            [],
            [],
            "--reward pickscore needs its weights: --reward_model pickscore=PATH_OR_HUB_ID"
            " (published: yuvalkirstain/PickScore_v1)",
        ),
        (["pickscore", "pickscore=2"], ["pickscore=p"], [], "--reward pickscore is given twice"),
        (
            ["pickscore"],
            ["pickscore=p", "pickscore=q"],
            [],
            "--reward_model pickscore is given twice ('p' and 'q')",
        ),
        (
            ["pickscore"],
            ["pickscore=p"],
            ["pickscore=shard", "pickscore=replicate"],
            "--reward_placement pickscore is given twice ('shard' and 'replicate')",
        ),
        (
            ["pickscore"],
            ["pickscore=p"],
            ["pickscore=cache"],
            "--reward_placement pickscore=cache: choose one of replicate, shard, offload",
        ),
        (["pickscore"], ["pickscore"], [], "--reward_model 'pickscore': expected NAME=PATH_OR_HUB_ID"),
        (
            [f"{SELF}:brightness"],
            [f"{SELF}:brightness=p"],
            [],
            f"--reward_model {SELF}:brightness: a function reward has no model to load or place",
        ),
        (
            ["hpsv2"],
            [],
            [],
            "--reward hpsv2 needs its weights: --reward_model hpsv2=PATH_OR_HUB_ID (published: xswu/HPSv2)",
        ),
        (
            ["imagereward"],
            [],
            [],
            "--reward imagereward needs its weights: --reward_model imagereward=PATH_OR_HUB_ID"
            " (published: THUDM/ImageReward)",
        ),
    ],
)
def test_each_spec_mistake_is_one_argument_error(rewards, models, placements, message):
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.rewards import parse_reward_specs

    with pytest.raises(ArgumentError) as e:
        parse_reward_specs(rewards, models, placements)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ output checks, weighted sum


def _function_rewards(*names_weights):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    return load_rewards(parse_reward_specs([f"{SELF}:{n}={w}" for n, w in names_weights]))


@pytest.mark.unit
def test_weighted_sum_of_function_rewards():
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    rewards = _function_rewards(("brightness", 2.0), ("prompt_length", -0.5))
    total, scores = rewards(images, PROMPTS)
    assert list(scores) == [f"{SELF}:brightness", f"{SELF}:prompt_length"]
    torch.testing.assert_close(scores[f"{SELF}:brightness"], brightness(images, PROMPTS))
    torch.testing.assert_close(
        total, 2.0 * brightness(images, PROMPTS) - 0.5 * prompt_length(images, PROMPTS)
    )
    assert total.dtype == torch.float32 and total.shape == (4,)
    total, scores = rewards(images[:0], [])  # no samples on this rank
    assert total.shape == (0,) and all(s.shape == (0,) for s in scores.values())


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, message",
    [
        (
            "one_short",
            "reward 'tests.test_reward_registry:one_short' returned shape (3,) for 4 samples"
            " (one score per sample expected)",
        ),
        (
            "nan_on_second",
            "reward 'tests.test_reward_registry:nan_on_second' returned NaN for 1 of 4 samples",
        ),
        ("inf_on_first", "reward 'tests.test_reward_registry:inf_on_first' returned inf for 1 of 4 samples"),
        (
            "raises",
            "reward 'tests.test_reward_registry:raises' raised RuntimeError: the scoring service is down",
        ),
    ],
)
def test_a_bad_reward_output_is_one_reward_error_naming_it(name, message):
    from diffusers_zero3.errors import RewardError

    rewards = _function_rewards(("brightness", 1.0), (name, 1.0))
    with pytest.raises(RewardError) as e:
        rewards(torch.rand(4, 3, 8, 8), PROMPTS)
    assert str(e.value) == message


@pytest.mark.unit
def test_frame_indices_are_evenly_spaced_first_to_last():
    from diffusers_zero3.rewards.registry import frame_indices

    assert frame_indices(81, 8) == [0, 11, 23, 34, 46, 57, 69, 80]
    assert frame_indices(9, 3) == [0, 4, 8] and frame_indices(5, 1) == [0]
    assert frame_indices(5, 0) == frame_indices(5, 8) == [0, 1, 2, 3, 4]


@pytest.mark.unit
def test_clips_reach_a_video_reward_whole_and_an_image_reward_frame_by_frame():
    """Clips ``[B, F, 3, H, W]``: a reward that declares ``takes_videos`` sees them whole; an image
    reward scores ``--reward_frames`` of each clip's frames (each with its clip's prompt and
    metadata row) and the clip gets their mean; a wrong count from it is one error line."""
    from diffusers_zero3.errors import RewardError
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from diffusers_zero3.rewards.registry import ClipScoring, frame_indices

    clips = torch.rand(3, 9, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    clips[1, 4] = 1.0  # a bright middle frame: seen with 3 frames (0, 4, 8), not with 2 (0, 8)
    specs = parse_reward_specs([f"{SELF}:motion", f"{SELF}:brightness=2", f"{SELF}:brightness_and_colour"])
    assert [s.takes_videos for s in specs] == [True, False, False]
    metadata = [{"color": "red"}, {}, {"color": "blue"}]
    for frames in (3, 2, 0):
        rewards = load_rewards(specs, clips=ClipScoring(frames))
        total, scores = rewards(clips, PROMPTS[:3], metadata=metadata)
        chosen = frame_indices(9, frames)
        per_frame = clips[:, chosen].mean(dim=(2, 3, 4))  # [B, frames]
        torch.testing.assert_close(scores[f"{SELF}:motion"], motion(clips, None))
        torch.testing.assert_close(scores[f"{SELF}:brightness"], per_frame.mean(dim=1))
        torch.testing.assert_close(
            scores[f"{SELF}:brightness_and_colour"], per_frame.mean(dim=1) + torch.tensor([1.0, 0.0, 1.0])
        )
        torch.testing.assert_close(total, sum(scores.values()) + scores[f"{SELF}:brightness"])
    # the positive control: the bright frame 4 counts with 3 frames and not with 2
    three = load_rewards(specs, clips=ClipScoring(3))(clips, PROMPTS[:3], metadata=metadata)[1][
        f"{SELF}:brightness"
    ]
    two = load_rewards(specs, clips=ClipScoring(2))(clips, PROMPTS[:3], metadata=metadata)[1][
        f"{SELF}:brightness"
    ]
    assert three[1] - two[1] > 0.05 and torch.allclose(three[[0, 2]], two[[0, 2]], atol=0.2)
    with pytest.raises(RewardError) as e:
        load_rewards(parse_reward_specs([f"{SELF}:one_short"]), clips=ClipScoring(2))(clips, PROMPTS[:3])
    assert str(e.value) == (
        f"reward '{SELF}:one_short' raised ValueError: returned (5,) for 3 clips x 2 frames (one score per frame expected)"
    )


# ------------------------------------------------------------------ tiny published architectures


def _tiny_clip(seed: int = 0):
    from transformers import CLIPConfig, CLIPModel

    from diffusers_zero3.demo.pipelines import tiny_clip_config

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=tiny_clip_config(hidden_size=32, projection_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=16),
        projection_dim=16,
        logit_scale_init_value=3.0,
    )  # fmt: skip
    return CLIPModel(config).eval()


def _clip_processor_files(folder):
    """The tokenizer and a CLIP image processor of the tiny CLIP's size, saved in ``folder``."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from diffusers_zero3.demo.tokenizers import write_clip_tokenizer

    write_clip_tokenizer(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        folder
    )


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny CLIP (a PickScore / CLIPScore model) with its processor files, as a hub folder."""
    folder = tmp_path_factory.mktemp("clip")
    _tiny_clip().save_pretrained(folder)
    _clip_processor_files(folder)
    return folder


def _laion_mlp(input_size: int):
    """improved-aesthetic-predictor's ``MLP`` (its ``layers``, so its state dict loads)."""

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(
                torch.nn.Linear(input_size, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16),
                torch.nn.Linear(16, 1),
            )  # fmt: skip

        def forward(self, x):
            return self.layers(x)

    return MLP().eval()


@pytest.fixture(scope="module")
def aesthetic_folder(tmp_path_factory):
    """The published layout: ``clip/`` (a whole CLIP model and its processor) and LAION's head
    as a ``.pth`` state dict."""
    folder = tmp_path_factory.mktemp("aesthetic")
    _tiny_clip(seed=1).save_pretrained(folder / "clip")
    _clip_processor_files(folder / "clip")
    torch.manual_seed(2)
    torch.save(_laion_mlp(16).state_dict(), folder / "sac+logos+ava1-l14-linearMSE.pth")
    return folder


VLM_TEMPLATE = (  # Qwen2-VL's chat template rendered for [image, text] and the generation prompt
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)
VLM_QUESTION = "Does this image match the prompt '{prompt}'? Answer Yes or No."


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    """A tiny Qwen2-VL (the published patch, merge and temporal sizes; narrow and shallow), its
    tokenizer (byte-level, Qwen2-VL's special tokens, "Yes" and "No" one token each) and image
    processor config."""
    from tests.common import tiny_qwen2_vl_judge

    folder = tmp_path_factory.mktemp("vlm")
    words = ("Yes", "No", "system", "user", "assistant", "You are a helpful assistant.", VLM_QUESTION)
    # P(Yes) ~0.64, not 0.5
    tiny_qwen2_vl_judge(folder, words, seed=3, max_position_embeddings=512).save_pretrained(folder)
    return folder


def _ours(name: str, folder, images: torch.Tensor, prompts, dtype, **kwargs) -> torch.Tensor:
    """Our scores: the spec parsed, the model loaded and placed replicated, through
    ``ParallelReward`` (one process)."""
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    specs = parse_reward_specs([name], [f"{name}={folder}"], [f"{name}=replicate"])
    rewards = load_rewards(specs, None, dtype, **kwargs)
    assert rewards.rewards[name].model.placement == "replicate"
    total, scores = rewards(images, prompts)
    torch.testing.assert_close(total, scores[name])
    return scores[name]


# ------------------------------------------------------------------ the authors' computations


def _pickscore_logit_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """yuvalkirstain/PickScore README: processor inputs, get_image_features / get_text_features
    (transformers 5: ``.pooler_output``), L2-normalised, ``logit_scale.exp() * text @ image.T``."""
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(folder, dtype=dtype).eval()
    image_inputs = CLIPImageProcessorPil.from_pretrained(folder)(images=_pil(images), return_tensors="pt")
    text_inputs = AutoTokenizer.from_pretrained(folder)(
        prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        image_embs = model.get_image_features(
            pixel_values=image_inputs["pixel_values"].to(dtype)
        ).pooler_output
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = model.get_text_features(**text_inputs).pooler_output
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
    return scores.diagonal().float()


def _pickscore_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """flow_grpo's (and DiffusionNFT's) ``flow_grpo/pickscore_scorer.py`` ``PickScoreScorer``:
    the README's computation, then ``scores = scores / 26`` ("norm to 0-1")."""
    return _pickscore_logit_reference(folder, images, prompts, dtype) / 26


def _clip_score_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """DiffusionNFT's ``flow_grpo/clip_scorer.py`` ``ClipScorer``: the processor's text padded to
    ``max_length``, ``CLIPModel.forward``, ``outputs.logits_per_image.diagonal() / 100`` (the
    cosine for a CLIP whose ``logit_scale.exp()`` is 100, as OpenAI's), not clamped."""
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(folder, dtype=dtype).eval()
    pixels = CLIPImageProcessorPil.from_pretrained(folder)(images=_pil(images), return_tensors="pt")[
        "pixel_values"
    ]
    texts = AutoTokenizer.from_pretrained(folder)(
        prompts, padding="max_length", truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        outputs = model(pixel_values=pixels.to(dtype), **texts)
    return (outputs.logits_per_image.diagonal() / 100).float()


def _clip_score_100_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """torchmetrics ``_clip_score_update`` per sample: normalised features,
    ``100 * (img * txt).sum(-1)``, then ``max(score, 0)``."""
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(folder, dtype=dtype).eval()
    pixels = CLIPImageProcessorPil.from_pretrained(folder)(images=_pil(images), return_tensors="pt")[
        "pixel_values"
    ]
    text = AutoTokenizer.from_pretrained(folder)(
        prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        img = model.get_image_features(pixel_values=pixels.to(dtype)).pooler_output
        txt = model.get_text_features(**text).pooler_output
        img = img / img.norm(p=2, dim=-1, keepdim=True)
        txt = txt / txt.norm(p=2, dim=-1, keepdim=True)
        score = 100 * (img * txt).sum(axis=-1)
    return torch.max(score, torch.zeros_like(score)).float()


def _aesthetic_reference(folder, images: np.ndarray, dtype) -> torch.Tensor:
    """improved-aesthetic-predictor ``simple_inference.py``: ``encode_image`` (CLIP's projected
    image embedding), ``normalized`` (numpy L2, a zero norm left at 1), the MLP."""
    from transformers import CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    clip = CLIPModel.from_pretrained(folder / "clip", dtype=dtype).eval()
    mlp = _laion_mlp(16)
    mlp.load_state_dict(torch.load(folder / "sac+logos+ava1-l14-linearMSE.pth", weights_only=True))
    mlp.to(dtype)
    pixels = CLIPImageProcessorPil.from_pretrained(folder / "clip")(images=_pil(images), return_tensors="pt")
    with torch.no_grad():
        features = clip.get_image_features(pixel_values=pixels["pixel_values"].to(dtype)).pooler_output
        a = features.float().numpy()
        l2 = np.atleast_1d(np.linalg.norm(a, 2, -1))
        l2[l2 == 0] = 1
        emb = a / np.expand_dims(l2, -1)
        return mlp(torch.from_numpy(emb).to(dtype)).squeeze(-1).float()


def _vlm_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """One sample at a time as Qwen2-VL's processor builds it (the image processor's patches and
    grid; the chat with ``<|image_pad|>`` repeated ``grid.prod() // merge**2`` times,
    ``mm_token_type_ids`` 1 on those), the next token's probabilities over the whole vocabulary,
    ``P(Yes) / (P(Yes) + P(No))``."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    scores = []
    for image, prompt in zip(_pil(images), prompts):
        vision = processor(images=[image], return_tensors="pt")
        n = int(vision["image_grid_thw"][0].prod()) // processor.merge_size**2
        text = VLM_TEMPLATE.format(question=VLM_QUESTION.format(prompt=prompt))
        inputs = tok([text.replace("<|image_pad|>", "<|image_pad|>" * n)], return_tensors="pt")
        with torch.no_grad():
            logits = model(
                **inputs,
                pixel_values=vision["pixel_values"].to(dtype),
                image_grid_thw=vision["image_grid_thw"],
                mm_token_type_ids=(inputs["input_ids"] == model.config.image_token_id).long(),
            ).logits[0, -1]
        p = logits.float().softmax(-1)
        scores.append(p[yes] / (p[yes] + p[no]))
    return torch.stack(scores)


# ------------------------------------------------------------------ each built-in against it


CLIP_REFERENCES = {
    "pickscore": _pickscore_reference,
    "pickscore_logit": _pickscore_logit_reference,
    "clip_score": _clip_score_reference,
    "clip_score_100": _clip_score_100_reference,
}


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pickscore_and_clip_score_are_their_references_computations(clip_folder, dtype):
    """In a run of ``dtype``: each CLIP built-in equals its reference's fp32 scores within fp32
    bounds (a bf16 run scores in fp32, as the RL references do), on its reference's scale:
    ``pickscore`` and ``clip_score`` as flow_grpo / DiffusionNFT score (a weight copied from
    their configs means the same here), ``pickscore_logit`` and ``clip_score_100`` as the
    PickScore README and torchmetrics."""
    images = _uint8_images(12, 32, 32)  # the processor's own size: nothing resized
    prompts = PROMPTS * 3
    expected = {}
    for name, reference in CLIP_REFERENCES.items():
        ours = _ours(name, clip_folder, _as_tensor(images), prompts, dtype)
        expected[name] = reference(clip_folder, images, prompts, torch.float32)
        torch.testing.assert_close(ours, expected[name], **_tolerance(name, dtype), msg=name)
    # controls: the scales differ as their references say (the tiny CLIP's logit scale is e**3),
    # and the torchmetrics clamp is in effect on both sides while DiffusionNFT's cosine is not clamped
    torch.testing.assert_close(expected["pickscore"] * 26, expected["pickscore_logit"])
    cos = expected["clip_score"] * 100 / math.exp(3.0)
    torch.testing.assert_close(expected["clip_score_100"], 100 * cos.clamp(min=0))
    assert (cos > 0).sum() >= 3 and (cos < 0).any(), "a control: scores on both sides of the clamp"


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_aesthetic_is_laions_computation_and_saves_and_loads(aesthetic_folder, tmp_path, dtype):
    from diffusers_zero3.rewards.builtin import AestheticPredictor

    images = _uint8_images(3, 32, 32, seed=1)
    ours = _ours("aesthetic", aesthetic_folder, _as_tensor(images), PROMPTS[:3], dtype)
    torch.testing.assert_close(  # fp32 in a bf16 run too
        ours, _aesthetic_reference(aesthetic_folder, images, torch.float32), **_tolerance("aesthetic", dtype)
    )
    # Saved by us (a vision-only CLIP, the head as safetensors) and read back: the same scores.
    AestheticPredictor.from_pretrained(aesthetic_folder).save_pretrained(tmp_path / "saved")
    torch.testing.assert_close(_ours("aesthetic", tmp_path / "saved", _as_tensor(images), None, dtype), ours)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vlm_judge_is_the_processor_and_model_computation(vlm_folder, dtype):
    images = _uint8_images(3, 56, 56, seed=2)  # a multiple of 28 within min_pixels: nothing resized
    prompts = PROMPTS[:3]  # of different lengths: our batch is left-padded, the reference is not
    ours = _ours("vlm", vlm_folder, _as_tensor(images), prompts, dtype, micro_batch_size=2)
    expected = _vlm_reference(vlm_folder, images, prompts, dtype)
    torch.testing.assert_close(ours, expected, **_tolerance("vlm", dtype))
    # Controls: the scores differ between samples, and the image's layout moves them by far more
    # than the fp32 bound (a tiny random judge barely looks at the image: ~1e-3).
    assert ours.max() - ours.min() > 1e-3, ours
    if dtype == torch.float32:
        transposed = _ours("vlm", vlm_folder, _as_tensor(images).transpose(-1, -2), prompts, dtype)
        assert (transposed - ours).abs().max() > 1e-4


@pytest.mark.unit
def test_resized_images_match_the_pil_processors_to_a_level():
    """Where the processor resizes (Pillow's bicubic on 8-bit pixels), ours (torch's antialiased
    bicubic on floats) agrees to about one 8-bit level (Pillow rounds its result to 8 bits);
    at the processor's own size, and in CLIP's crop and Qwen2-VL's patch layout, exactly."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.rewards.images import (
        ClipImageConfig,
        QwenVLImageConfig,
        clip_pixel_values,
        qwen_vl_patches,
    )

    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])
    level = (1.5 / 255 / std.min()).item()  # 1.5 8-bit levels, in normalised units
    for size in ((40, 52), (52, 40), (32, 32), (24, 30)):  # shrink, either side longer, none, enlarge
        images = _smooth_images(2, *size, seed=3)
        processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        expected = processor(images=_pil(images), return_tensors="pt")["pixel_values"]
        cfg = ClipImageConfig.from_processor_dict(processor.to_dict())
        ours = clip_pixel_values(_as_tensor(images), cfg)
        assert ours.shape == expected.shape
        atol = 1e-5 if size == (32, 32) else level
        torch.testing.assert_close(ours, expected, rtol=0, atol=atol, msg=str(size))

        processor = Qwen2VLImageProcessorPil()
        images = _smooth_images(2, size[0] + 20, size[1] + 20, seed=4)  # 60x72 -> 56x84, ...
        expected = processor(images=_pil(images), return_tensors="pt")
        cfg = QwenVLImageConfig.from_processor_dict(processor.to_dict())
        patches, gh, gw = qwen_vl_patches(_as_tensor(images), cfg)
        assert expected["image_grid_thw"].tolist() == [[1, gh, gw]] * 2
        torch.testing.assert_close(
            patches.reshape(-1, patches.shape[-1]), expected["pixel_values"], rtol=0, atol=level
        )


@pytest.mark.unit
def test_packed_rows_keep_token_ids_exact_through_a_bf16_cast():
    from diffusers_zero3.rewards.images import pack_rows, unpack_rows

    ints = torch.tensor([[0, 255, 256, 151_655, 2**24 - 1], [7, 1, 0, 49_407, 65_536]])
    floats = torch.randn(2, 6, requires_grad=True)
    rows = pack_rows(ints, floats)
    back_ints, back_floats = unpack_rows(rows.to(torch.bfloat16))
    assert torch.equal(back_ints, ints)
    torch.testing.assert_close(back_floats.float(), floats.detach().bfloat16().float())
    unpack_rows(rows)[1].sum().backward()  # the floats stay in the graph
    assert torch.equal(floats.grad, torch.ones_like(floats))
    with pytest.raises(ValueError, match="packed integers must lie in"):
        pack_rows(torch.tensor([[2**24]]), floats[:1])


@pytest.mark.unit
def test_pickscore_is_differentiable_in_the_images(clip_folder):
    images = _as_tensor(_uint8_images(2, 40, 36, seed=5)).requires_grad_(True)
    scores = _ours("pickscore", clip_folder, images, PROMPTS[:2], torch.float32, differentiable=True)
    scores.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0 and torch.isfinite(images.grad).all()


@pytest.mark.unit
def test_a_reward_given_fewer_prompts_than_images_names_both_counts(clip_folder):
    from diffusers_zero3.rewards.builtin import PickScore

    model = PickScore.from_pretrained(clip_folder)
    images = _as_tensor(_uint8_images(2, 40, 36, seed=5))
    with pytest.raises(
        ValueError, match="'pickscore' needs one prompt per image: got 2 images and 1 prompts"
    ):
        model.preprocess(images, PROMPTS[:1])
    with pytest.raises(ValueError, match="got 2 images and no prompts"):
        model.preprocess(images, None)
    assert model.preprocess(images, PROMPTS[:2]).shape[0] == 2  # the control: one prompt each


@pytest.mark.unit
def test_a_vlm_of_another_kind_or_a_multi_token_answer_is_refused(vlm_folder):
    from diffusers_zero3.rewards.builtin import VLMJudge

    with pytest.raises(ValueError, match="answer 'Maybe not' must be one token"):
        VLMJudge.from_pretrained(vlm_folder, answers=("Yes", "Maybe not"))
    judge = VLMJudge.from_pretrained(vlm_folder)
    judge.model.config.model_type = "llava"
    with pytest.raises(ValueError, match="takes a Qwen2-VL or Qwen2.5-VL model"):
        VLMJudge(judge.model, judge.tokenizer, judge.image_config)


@pytest.mark.unit
def test_the_vlm_question_reaches_the_judge_and_changes_its_scores(vlm_folder):
    """``load_rewards(..., vlm_question=...)`` (``--vlm_question``) asks the judge another
    question: its text is the chat the judge sees, and the scores move with it."""
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    images = _as_tensor(_uint8_images(2, 40, 36, seed=7))
    specs = parse_reward_specs(["vlm"], [f"vlm={vlm_folder}"], ["vlm=replicate"])
    asked = load_rewards(specs, None, torch.float32, vlm_question="Is it red? {prompt}")
    judge = asked.rewards["vlm"].model.module
    assert judge.question == "Is it red? {prompt}" and "Is it red? a cat" in judge.chat("a cat", 1)
    default = load_rewards(specs, None, torch.float32)
    moved = (asked(images, PROMPTS[:2])[0] - default(images, PROMPTS[:2])[0]).abs().max().item()
    assert moved > 1e-6, moved


# ------------------------------------------------------------------ 2 ranks


def worker_sharded_pickscore(folder: str, vlm_folder: str, ref_path: str):
    from diffusers_zero3.errors import RewardError
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = accelerator.process_index
    ref = torch.load(ref_path)
    images, expected = ref["images"], ref["scores"]

    def rewards_placed(placement):
        specs = parse_reward_specs(["pickscore"], [f"pickscore={folder}"], [f"pickscore={placement}"])
        return load_rewards(specs, accelerator, torch.float32, micro_batch_size=2)

    sharded, replicated = rewards_placed("shard"), rewards_placed("replicate")
    assert sharded.rewards["pickscore"].model.is_sharded
    assert sharded.rewards["pickscore"].model.module.clip.logit_scale.dim() == 0  # kept whole, a buffer
    assert not replicated.rewards["pickscore"].model.is_sharded
    # Uneven counts, zero included: rank 0 makes 2 micro-batches, rank 1 one or none (padded).
    for counts in ((3, 1), (3, 0), (0, 3)):
        sl = rank_slice(counts, rank)
        with sharded.lockstep_check():
            total, scores = sharded(images[sl], PROMPTS[sl])
        _, replica = replicated(images[sl], PROMPTS[sl])
        assert scores["pickscore"].shape == (counts[rank],)
        torch.testing.assert_close(scores["pickscore"], replica["pickscore"])
        torch.testing.assert_close(scores["pickscore"], expected[sl])
        torch.testing.assert_close(total, expected[sl])

    # A bad score on one rank only is the same RewardError on both, not one rank leaving the other
    # in the next collective.
    specs = parse_reward_specs(["pickscore", f"{SELF}:nan_on_second"], [f"pickscore={folder}"])
    both = load_rewards(specs, accelerator, torch.float32)
    counts = (1, 3)  # only rank 1 has a second sample
    sl = rank_slice(counts, rank)
    with pytest.raises(RewardError) as e:
        both(images[sl], PROMPTS[sl])
    assert str(e.value) == f"reward '{SELF}:nan_on_second' returned NaN for 1 of 3 samples on rank 1"
    print("OK sharded pickscore")

    # The sharded judge is read straight into partitions: its class's whole-model
    # from_pretrained is never called (it would raise here), and its scores are the replica's.
    from transformers import Qwen2VLForConditionalGeneration

    def whole(*args, **kwargs):
        raise AssertionError("the sharded judge was loaded whole")

    original = Qwen2VLForConditionalGeneration.from_pretrained
    Qwen2VLForConditionalGeneration.from_pretrained = whole
    try:
        specs = parse_reward_specs(["vlm"], [f"vlm={vlm_folder}"])
        judge = load_rewards(specs, accelerator, torch.float32, micro_batch_size=2)
    finally:
        Qwen2VLForConditionalGeneration.from_pretrained = original
    assert judge.rewards["vlm"].model.is_sharded
    for counts in ((3, 1), (0, 4)):
        sl = rank_slice(counts, rank)
        with judge.lockstep_check():
            _, scores = judge(images[sl], PROMPTS[sl])
        torch.testing.assert_close(scores["vlm"], ref["vlm"][sl], rtol=1e-5, atol=1e-6)
    print("OK sharded vlm")


@pytest.mark.multirank
def test_sharded_pickscore_and_vlm_equal_the_replicas_on_two_ranks_with_uneven_samples(
    clip_folder, vlm_folder, tmp_path
):
    images = _as_tensor(_uint8_images(4, 40, 36, seed=6))
    expected = _ours("pickscore", clip_folder, images, PROMPTS, torch.float32)
    vlm_expected = _ours("vlm", vlm_folder, images, PROMPTS, torch.float32)
    torch.save({"images": images, "scores": expected, "vlm": vlm_expected}, tmp_path / "ref.pt")
    outs = run_on_ranks(
        worker_sharded_pickscore,
        timeout=240,
        folder=str(clip_folder),
        vlm_folder=str(vlm_folder),
        ref_path=str(tmp_path / "ref.pt"),
    )
    assert all("OK sharded pickscore" in o and "OK sharded vlm" in o for o in outs)


@pytest.mark.unit
def test_a_model_class_spec_needs_its_weights_and_a_model_with_from_pretrained():
    """``module:Class`` is a reward model class (placed like a built-in, default shard); a class
    that is no model, or a model class without ``--reward_model``, is refused in one line."""
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.rewards import parse_reward_specs

    (spec,) = parse_reward_specs(
        ["diffusers_zero3.demo:RednessRewardModel=0.5"], ["diffusers_zero3.demo:RednessRewardModel=/w"]
    )
    assert (spec.weight, spec.model_path, spec.placement, spec.has_model, spec.is_builtin) == (
        0.5,
        "/w",
        "shard",
        True,
        False,
    )
    with pytest.raises(ArgumentError, match="needs its weights: --reward_model"):
        parse_reward_specs(["diffusers_zero3.demo:RednessRewardModel"])
    with pytest.raises(ArgumentError, match="is a class but not a model with from_pretrained"):
        parse_reward_specs(["diffusers_zero3.rewards.specs:RewardSpec"])
