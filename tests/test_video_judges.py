"""The judge of whole clips ``unifiedreward_video`` (``rewards.vlm_judges.UnifiedRewardVideo``,
``rewards.videos``) against its authors' scoring transcribed here with plain transformers
calls, on a tiny Qwen2.5-VL of the published shapes, and sharded on 2 real ranks against its
replica.

The reference (read from the authors' code; none of their packages is imported, and neither
qwen-vl-utils nor transformers' Qwen2-VL video processor runs here: both need torchvision):

* UnifiedReward (CodeGoat24/UnifiedReward,
  ``inference_qwen/video_generation/qwen_point_score_video_generation.py``): one video at a time,
  the chat [video, question], ``process_vision_info(messages, return_video_kwargs=True)`` and the
  processor's inputs with the sampled ``fps``, ``model.generate(**inputs, max_new_tokens=1024)``
  with the model's generation config, the new tokens decoded (``skip_special_tokens=True``); the
  grade is the first integer after the last ``Final Score:`` (``VideoDPO/sift_dpo_data.py``), here
  divided by 10.
* qwen-vl-utils 0.0.11 ``vision_process.py``: ``smart_nframes``, the decord reader's
  ``torch.linspace(0, total - 1, n).round()`` and ``sample_fps``, ``fetch_video``'s pixel bounds and
  torchvision's bicubic antialiased resize of the 8-bit frames (rounded back to 8 bits), ``.float()``.
* transformers 5's ``Qwen2VLVideoProcessor`` (``video_processing_qwen2_vl.py``: ``smart_resize``
  with the processor's own range, the fused rescale-and-normalise, ``patchify``) and
  ``Qwen2_5_VLProcessor`` (``second_per_grid_ts = temporal_patch_size / fps``; the video's
  ``<|video_pad|>`` repeated ``grid_t * grid_h * grid_w / merge**2`` times; ``mm_token_type_ids``
  2 at those tokens).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.common import rank_slice
from tests.distributed_harness import run_on_ranks
from tests.test_reward_registry import PROMPTS
from tests.test_reward_vlm_judges import QWEN_VL_CHAT, _digit_ids, _tiny_judge, _tokenizer

MAX_NEW_TOKENS = 8
SIDE = 56  # a multiple of the patch merge (28)
FRAMES = 4
VIDEO_FPS = 2.0  # 4 frames at 2 fps: 4 sampled, one second per temporal patch, positions 0 and 2
# The score tests keep the clips at their size (the reference's "min_pixels" message key): the
# pixels are then the reference's to float rounding and the generated answers must be equal.
# The default bounds upscale these clips to 336 x 336 (checked in the packing test).
UNRESIZED = dict(min_pixels=SIDE * SIDE)
GRADES = "123456789"  # the tiny judge's answers "Final Score: N"


def _clips(n: int, frames: int = FRAMES, side: int = SIDE, seed: int = 0) -> np.ndarray:
    """``n`` random 8-bit clips ``[n, F, 3, H, W]`` (what a video file decodes to)."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, frames, 3, side, side), dtype=np.uint8)


def _as_videos(clips: np.ndarray) -> torch.Tensor:
    """The clips as a judge of clips takes them: float ``[B, F, 3, H, W]`` in ``[0, 1]``."""
    return torch.from_numpy(clips).float() / 255


# ------------------------------------------------------------------ the reference, written out


def _ref_smart_nframes(total: int, video_fps: float, ele: dict) -> int:
    """qwen-vl-utils' ``smart_nframes`` (fps branch, its defaults)."""
    fps = ele.get("fps", 2.0)
    min_frames = math.ceil(ele.get("min_frames", 4) / 2) * 2
    max_frames = math.floor(ele.get("max_frames", min(768, total)) / 2) * 2
    nframes = total / video_fps * fps
    nframes = min(min(max(nframes, min_frames), max_frames), total)
    nframes = math.floor(nframes / 2) * 2
    if not (2 <= nframes and nframes <= total):
        raise ValueError(f"nframes should in interval [2, {total}], but got {nframes}.")
    return nframes


def _ref_smart_resize(height, width, factor, min_pixels, max_pixels):
    """qwen-vl-utils' ``smart_resize`` (transformers' the same but for ``max(factor, .)``)."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _torchvision_resize(video: torch.Tensor, size) -> torch.Tensor:
    """torchvision's ``resize(..., BICUBIC, antialias=True)`` of a uint8 ``[T, C, H, W]``: float
    interpolation, clamped and rounded back to uint8 (float input: no clamp, no rounding)."""
    out = F.interpolate(video.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.clamp(0, 255).round().to(torch.uint8) if video.dtype == torch.uint8 else out


def _ref_fetch_video(video: torch.Tensor, video_fps: float, ele: dict) -> tuple[torch.Tensor, float]:
    """qwen-vl-utils' ``fetch_video`` of a decoded uint8 video ``[T, C, H, W]`` at ``video_fps``:
    the sampled, resized frames (float, 0-255) and the sampled frame rate."""
    total = video.shape[0]
    nframes = _ref_smart_nframes(total, video_fps, ele)
    idx = torch.linspace(0, total - 1, nframes).round().long().tolist()
    sample_fps = nframes / max(total, 1e-6) * video_fps
    video = video[idx]
    nframes, _, height, width = video.shape
    min_pixels = ele.get("min_pixels", 128 * 28 * 28)
    total_pixels = ele.get("total_pixels", int(128000 * 28 * 28 * 0.9))
    max_pixels = max(min(768 * 28 * 28, total_pixels / nframes * 2), int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    size = _ref_smart_resize(height, width, 28, min_pixels, max_pixels)
    return _torchvision_resize(video, size).float(), sample_fps


def _ref_video_processor(video: torch.Tensor, processor: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Qwen2VLVideoProcessor`` on one float video ``[T, C, H, W]`` (0-255):
    ``(pixel_values_videos, video_grid_thw)``."""
    # video_processing_qwen2_vl.smart_resize, the same text (that module imports torchvision)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    p, m, t = processor["patch_size"], processor["merge_size"], processor["temporal_patch_size"]
    size = smart_resize(*video.shape[-2:], factor=p * m, min_pixels=processor["min_pixels"],
                        max_pixels=processor["max_pixels"])  # fmt: skip
    videos = _torchvision_resize(video, size)[None]
    # rescale_and_normalize fused: mean and std times 1 / rescale_factor
    mean = torch.tensor(processor["image_mean"]).view(1, 1, -1, 1, 1) * 255
    std = torch.tensor(processor["image_std"]).view(1, 1, -1, 1, 1) * 255
    videos = (videos - mean) / std
    batch_size, num_frames, channel, resized_height, resized_width = videos.shape
    if pad := -num_frames % t:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // t, resized_height // p, resized_width // p
    patches = videos.view(batch_size, grid_t, t, channel, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(batch_size, grid_t * grid_h * grid_w, channel * t * p * p)
    return flat[0], torch.tensor([[grid_t, grid_h, grid_w]])


def _processor_dict(folder) -> dict:
    from diffusers_zero3.rewards.builtin import _processor_dict

    cfg = _processor_dict(folder)
    size = cfg.get("size") or {}
    return dict(
        patch_size=cfg.get("patch_size", 14), merge_size=cfg.get("merge_size", 2),
        temporal_patch_size=cfg.get("temporal_patch_size", 2),
        min_pixels=cfg.get("min_pixels") or size["shortest_edge"], max_pixels=cfg.get("max_pixels") or size["longest_edge"],
        image_mean=cfg["image_mean"], image_std=cfg["image_std"],
    )  # fmt: skip


def _ref_inputs(folder, clip: np.ndarray, prompt: str, video_fps: float, ele: dict, dtype) -> dict:
    """The processor's inputs of the authors' chat [video, question] for one decoded clip."""
    from transformers import AutoTokenizer

    from diffusers_zero3.rewards.vlm_judges import UNIFIEDREWARD_VIDEO_QUESTION

    frames, sample_fps = _ref_fetch_video(torch.from_numpy(clip), video_fps, ele)
    processor = _processor_dict(folder)
    pixels, grid = _ref_video_processor(frames, processor)
    n = int(grid.prod()) // processor["merge_size"] ** 2
    text = QWEN_VL_CHAT.format(text=UNIFIEDREWARD_VIDEO_QUESTION.replace("{prompt}", prompt))
    text = text.replace("<|image_pad|>", "<|video_pad|>" * n)
    tok = AutoTokenizer.from_pretrained(folder)
    inputs = dict(tok([text], return_tensors="pt"))
    video_token = tok.convert_tokens_to_ids("<|video_pad|>")
    return inputs | dict(
        pixel_values_videos=pixels.to(dtype),
        video_grid_thw=grid,
        second_per_grid_ts=torch.tensor([processor["temporal_patch_size"] / sample_fps]),
        mm_token_type_ids=(inputs["input_ids"] == video_token).long() * 2,
    )


def _reference_generations(folder, clips: np.ndarray, prompts, dtype, ele=UNRESIZED, **generate_kwargs):
    """Per clip: the authors' ``model.generate(**inputs, max_new_tokens=...)``; ``(prompt
    length, output)``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    for clip, prompt in zip(clips, prompts):
        inputs = _ref_inputs(folder, clip, prompt, VIDEO_FPS, ele, dtype)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                                 **generate_kwargs)  # fmt: skip
        yield inputs["input_ids"].shape[1], out


def _reference(folder, clips: np.ndarray, prompts, dtype, ele=UNRESIZED) -> tuple[torch.Tensor, list[str]]:
    """The authors' pointwise video scoring (module docstring): the grades / 10 and the answers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    scores, answers = [], []
    for length, out in _reference_generations(folder, clips, prompts, dtype, ele):
        answer = tok.batch_decode(out.sequences[:, length:], skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False)[0]  # fmt: skip
        found = re.findall(r"\d+", answer.split("Final Score:")[-1].strip())
        scores.append(int(found[0]) / 10 if found else 0.0)
        answers.append(answer)
    return torch.tensor(scores), answers


# ------------------------------------------------------------------ the tiny judge


def _score_chain(tok, digit_bias: dict[int, float] | None = None) -> list:
    """``sequence_bias`` entries that make the tiny judge answer ``Final Score: <digit>`` and
    stop, the digit its own choice (as ``test_reward_vlm_judges._score_chain``, digits 1-9)."""
    newline = tok.encode("\n", add_special_tokens=False)
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    pairs = {}
    for digit in GRADES:
        chain = newline + tok.encode(f"Final Score: {digit}", add_special_tokens=False) + end
        for pair in zip(chain, chain[1:]):
            pairs[pair] = 40.0 + (digit_bias or {}).get(pair[1], 0.0)
    return [[list(pair), bias] for pair, bias in sorted(pairs.items())]


def _video_config(**overrides):
    from diffusers_zero3.rewards.videos import QwenVLVideoConfig

    return QwenVLVideoConfig(**{"video_fps": VIDEO_FPS, **UNRESIZED, **overrides})


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    return save_tiny_video_judge(tmp_path_factory.mktemp("unifiedreward-video"))


def save_tiny_video_judge(folder):
    """A tiny UnifiedReward video judge saved in ``folder``: a Qwen2.5-VL of the published head
    widths, its generation config the published one's (top-k 1 sampling, repetition penalty
    1.05) with a ``sequence_bias`` that makes it answer ``Final Score: N``, calibrated on the
    test's clips so that the digit follows each clip's own logits
    (``test_reward_vlm_judges._build_unified``). Returns ``folder``."""
    from transformers import GenerationConfig

    from diffusers_zero3.rewards.vlm_judges import UNIFIEDREWARD_VIDEO_QUESTION

    tok = _tokenizer(folder, texts=(UNIFIEDREWARD_VIDEO_QUESTION, "Final Score: " + " ".join(GRADES)))
    torch.manual_seed(13)
    model, processor = _tiny_judge("qwen2.5-vl", tok)
    text = model.config.text_config
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config = GenerationConfig(
        do_sample=True, top_k=1, top_p=0.001, temperature=0.1, repetition_penalty=1.05,
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        sequence_bias=_score_chain(tok),
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    chains = [tok.encode(f"Final Score: {d}", add_special_tokens=False) for d in GRADES]
    step, _ = _digit_ids(tok)
    digits = [c[step] for c in chains]
    outputs = _reference_generations(folder, _clips(4), PROMPTS, torch.float32, output_logits=True)
    logits = torch.stack([out.logits[step][0, digits] for _, out in outputs])
    model.generation_config.sequence_bias = _score_chain(
        tok, {d: -float(m) for d, m in zip(digits, logits.mean(0))}
    )
    model.generation_config.save_pretrained(folder)
    return folder


def _judge(folder, dtype=torch.float32, **video):
    from diffusers_zero3.rewards.vlm_judges import UnifiedRewardVideo

    judge = UnifiedRewardVideo.from_pretrained(folder, dtype, max_new_tokens=MAX_NEW_TOKENS)
    judge.video_config = _video_config(**video)
    return judge


# ------------------------------------------------------------------ packing


@pytest.mark.unit
@pytest.mark.parametrize(
    "frames, side, video_fps, bounds",
    [
        (4, 56, 2.0, UNRESIZED),  # kept as they are: equal to float rounding
        (6, 28, 16.0, UNRESIZED),  # 4 of 6 frames (0, 2, 3, 5), upscaled to 56 x 56
        (4, 56, 16.0, {}),  # the default bounds: upscaled to 336 x 336
        (81, 42, 16.0, {}),  # Wan's 81 frames at 16 fps: 10 sampled
        (3, 28, 16.0, {}),  # an odd clip: 2 frames
    ],
)
def test_video_patches_are_qwen_vl_utils_and_the_video_processor(frames, side, video_fps, bounds):
    from diffusers_zero3.rewards.images import QwenVLImageConfig
    from diffusers_zero3.rewards.videos import QwenVLVideoConfig, qwen_vl_video_patches

    image_config = QwenVLImageConfig()  # Qwen2.5-VL-7B-Instruct's processor: 56*56 to 28*28*1280
    processor = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                     max_pixels=28 * 28 * 1280, image_mean=image_config.mean, image_std=image_config.std)  # fmt: skip
    clips = _clips(2, frames, side, seed=frames)
    ours = qwen_vl_video_patches(
        _as_videos(clips), image_config, QwenVLVideoConfig(video_fps=video_fps, **bounds)
    )
    resized = False
    for i, clip in enumerate(clips):
        frames_ref, sample_fps = _ref_fetch_video(torch.from_numpy(clip), video_fps, bounds)
        pixels, grid = _ref_video_processor(frames_ref, processor)
        resized = frames_ref.shape[-1] != side
        assert ours.grid == tuple(grid[0].tolist())
        assert ours.second_per_grid == 2 / sample_fps
        # one 8-bit level (the reference rounds its resized frames to 8 bits) where resized
        atol = (0.5 / 255) / min(image_config.std) + 1e-5 if resized else 1e-5
        error = (ours.patches[i] - pixels).abs()
        print(f"{frames} frames {side}px -> {ours.grid}: max {error.max():.3g}, mean {error.mean():.3g}")
        torch.testing.assert_close(ours.patches[i], pixels, rtol=0, atol=atol)
    if frames == 81:
        assert ours.grid[0] == 5  # 10 frames
    # a control: the packing follows the frames' order
    swapped = _as_videos(clips)[:, [1, 0, *range(2, frames)]]
    other = qwen_vl_video_patches(swapped, image_config, QwenVLVideoConfig(video_fps=video_fps, **bounds))
    assert not torch.equal(other.patches, ours.patches)
    assert resized == (bounds == {} or side == 28)


@pytest.mark.unit
def test_bad_inputs_get_one_clear_error(judge_folder):
    judge = _judge(judge_folder)
    videos = _as_videos(_clips(2))
    with pytest.raises(
        ValueError, match=r"scores whole clips: it takes videos as a float tensor \[B, F, 3, H, W\]"
    ):
        judge.preprocess(videos[:, 0], PROMPTS[:2])  # images
    with pytest.raises(ValueError, match="needs clips of at least 2 frames"):
        judge.preprocess(videos[:, :1], PROMPTS[:2])
    with pytest.raises(ValueError, match="takes float videos"):
        judge.preprocess(torch.from_numpy(_clips(2)), PROMPTS[:2])
    with pytest.raises(ValueError, match="one prompt per clip: got 2 clips and 1 prompts"):
        judge.preprocess(videos, PROMPTS[:1])
    with pytest.raises(ValueError, match="takes a Qwen2-VL or Qwen2.5-VL model"):
        judge.model.config.model_type = "qwen3_vl"
        try:
            type(judge)(judge.model, judge.tokenizer, judge.image_config)
        finally:
            judge.model.config.model_type = "qwen2_5_vl"
    assert judge.preprocess(videos[:0], []).shape[0] == 0


# ------------------------------------------------------------------ scores


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unifiedreward_video_is_the_authors_generation_and_reading(judge_folder, dtype):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    clips = _clips(4)
    prompts = PROMPTS  # of different lengths: ours a left-padded batch, theirs one at a time
    expected, answers = _reference(judge_folder, clips, prompts, dtype)
    judge = _judge(judge_folder, dtype)
    with torch.no_grad():
        ours_answers = judge.answers(judge.preprocess(_as_videos(clips).to(dtype), prompts))
    print(f"unifiedreward_video {dtype}: answers {ours_answers}, reference {answers}")
    assert ours_answers == answers
    specs = parse_reward_specs(
        ["unifiedreward_video"], [f"unifiedreward_video={judge_folder}"], ["unifiedreward_video=replicate"]
    )
    reward = load_rewards(specs, None, dtype, micro_batch_size=3).rewards["unifiedreward_video"]
    reward.model.module.max_new_tokens = MAX_NEW_TOKENS
    reward.model.module.video_config = _video_config()
    scores = reward(_as_videos(clips), prompts)  # the ParallelReward: rows cast to the dtype, 2 micro-batches
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)
    assert all("Final Score:" in a for a in answers) and len(set(expected.tolist())) > 1  # controls


@pytest.mark.unit
def test_at_the_default_bounds_the_answers_are_the_authors(judge_folder):
    """qwen-vl-utils' own bounds (no message keys): the 56 px clips upscaled to 336 x 336, ours
    in float, theirs rounded to 8 bits (half a level apart, the packing test): the same answers."""
    clips = _clips(2, seed=5)
    expected, answers = _reference(judge_folder, clips, PROMPTS[:2], torch.float32, ele={})
    judge = _judge(judge_folder, min_pixels=128 * 28 * 28)
    rows = judge.preprocess(_as_videos(clips), PROMPTS[:2])
    assert judge.video_inputs(rows)["video_grid_thw"].tolist() == [[2, 24, 24]] * 2
    with torch.no_grad():
        ours = judge.answers(rows)
    print(f"default bounds: answers {ours}, reference {answers}")
    assert ours == answers


@pytest.mark.unit
def test_the_model_sees_the_clip_its_frame_order_and_its_timing(judge_folder):
    """Controls of the first answer token's logits: another clip, the frames reversed, and the
    clips' frame rate (the same 4 frames at 16 fps instead of 2: Qwen2.5-VL's
    ``second_per_grid_ts`` 0.125 instead of 1, both temporal patches at position 0 instead of 0
    and 2) each move them."""
    import dataclasses

    judge = _judge(judge_folder)
    videos = _as_videos(_clips(2, seed=3))

    def logits(videos):
        inputs = judge.video_inputs(judge.preprocess(videos, PROMPTS[:2]))
        with torch.no_grad():
            return judge.model(**inputs, logits_to_keep=1).logits[:, -1], inputs["second_per_grid_ts"]

    base, seconds = logits(videos)
    judge.video_config = dataclasses.replace(judge.video_config, video_fps=16.0)
    faster, faster_seconds = logits(videos)
    judge.video_config = _video_config()
    assert seconds.tolist() == [1.0, 1.0] and faster_seconds.tolist() == [0.125, 0.125]
    moves = {
        "other clip": (logits(videos.flip(0))[0].flip(0) - base)
        .abs()
        .max(),  # each prompt with the other clip
        "reversed frames": (logits(videos.flip(1))[0] - base).abs().max(),
        "frame rate": (faster - base).abs().max(),
    }
    print({k: f"{v:.3g}" for k, v in moves.items()})
    assert all(v > 1e-3 for v in moves.values()), moves


# ------------------------------------------------------------------ 2 ranks


def worker_sharded_video_judge(folder: str, ref_path: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = accelerator.process_index
    ref = torch.load(ref_path)

    def whole(*args, **kwargs):
        raise AssertionError("a sharded judge was loaded whole")

    original = Qwen2_5_VLForConditionalGeneration.from_pretrained
    Qwen2_5_VLForConditionalGeneration.from_pretrained = whole
    try:  # default placement: shard, read straight into partitions
        specs = parse_reward_specs(["unifiedreward_video"], [f"unifiedreward_video={folder}"])
        reward = load_rewards(specs, accelerator, torch.float32, micro_batch_size=2).rewards[
            "unifiedreward_video"
        ]
    finally:
        Qwen2_5_VLForConditionalGeneration.from_pretrained = original
    assert reward.model.is_sharded
    reward.model.module.max_new_tokens = MAX_NEW_TOKENS
    reward.model.module.video_config = _video_config()
    # Uneven counts, zero included: one rank makes more micro-batches (and generation steps).
    for counts in ((3, 1), (0, 4)):
        sl = rank_slice(counts, rank)
        with reward.lockstep_check():
            scores = reward(ref["videos"][sl], ref["prompts"][sl])
        error = (scores - ref["scores"][sl]).abs().max().item() if counts[rank] else 0.0
        print(f"rank {rank} {counts}: {counts[rank]} scores, max |sharded - replica| {error:.3g}")
        torch.testing.assert_close(scores, ref["scores"][sl], rtol=0, atol=0, msg=f"{counts}")
    print("OK sharded video judge")


@pytest.mark.multirank
def test_sharded_video_judge_equals_its_replica_on_two_ranks_with_uneven_clips(judge_folder, tmp_path):
    videos = _as_videos(_clips(4, seed=9))
    judge = _judge(judge_folder)
    with torch.no_grad():
        scores = judge(judge.preprocess(videos, PROMPTS))
    torch.save({"videos": videos, "prompts": PROMPTS, "scores": scores}, tmp_path / "ref.pt")
    outs = run_on_ranks(
        worker_sharded_video_judge, timeout=240, folder=str(judge_folder), ref_path=str(tmp_path / "ref.pt")
    )
    print("".join(line for o in outs for line in o.splitlines(keepends=True) if "max |sharded" in line))
    assert all("OK sharded video judge" in o for o in outs)


@pytest.mark.unit
def test_the_demo_judge_loads_as_the_published_one_and_grades_clips(tmp_path):
    """``diffusers_zero3.demo.judges.save_tiny_video_judge`` (``make train-grpo MODEL=wan``'s judge)
    loads through ``--reward unifiedreward_video`` as the published folder would, and answers
    ``Final Score: N`` for each clip: a grade in 0.1-0.9, one per clip."""
    from diffusers_zero3.demo.judges import save_tiny_video_judge
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    folder = save_tiny_video_judge(tmp_path / "judge")
    specs = parse_reward_specs(
        ["unifiedreward_video"], [f"unifiedreward_video={folder}"], ["unifiedreward_video=replicate"]
    )
    _, scores = load_rewards(specs)(_as_videos(_clips(2)), PROMPTS[:2])
    grades = scores["unifiedreward_video"]
    assert grades.shape == (2,) and all(round(10 * g) in range(1, 10) for g in grades.tolist()), grades
