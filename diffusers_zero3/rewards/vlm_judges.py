"""Vision-language judges as built-in rewards: HPSv3 and a UnifiedReward-style judge.

Both run on transformers' Qwen VL classes (no package of their authors is imported) and, like
the ``vlm`` judge (``builtin.VLMJudge``, whose rows and chat they share), are read straight into
ZeRO-3 partitions under ``shard`` (the default placement): a 7 B judge is never whole on a rank.

* ``hpsv3``: HPSv3 (Ma et al. 2025, MizzenAI/HPSv3). Its model (``hpsv3/model/qwen2vl_trainer.py``,
  ``Qwen2VLRewardModelBT`` with ``rm_head_type: ranknet``, ``reward_token: special``,
  ``output_dim: 2`` in ``hpsv3/config/HPSv3_7B.yaml``) is Qwen2-VL-7B-Instruct whose tokenizer
  gained one token, ``<|Reward|>`` (its embeddings resized to the new vocabulary), and an MLP
  head (``Linear(3584, 1024)``, ReLU, ``Dropout(0.05)``, ``Linear(1024, 16)``, ReLU,
  ``Linear(16, 2)``) held in fp32. Its inference (``hpsv3/inference.py``,
  ``HPSv3RewardInferencer``) asks its instruction about the image and the prompt, ending with
  ``<|Reward|>``; the language model's last hidden state (after the final norm) at that token,
  cast to fp32, goes through the head, and the first of its two outputs (mu; the second is the
  uncertainty) is the score. Three details of the reference that change the numbers, kept here:
  the text positions are sequential (its forward embeds the tokens itself and calls the
  decoder without ``input_ids``, so no multimodal RoPE indices are computed), every image is
  resized to 256 x 28 x 28 pixels (``min_pixels = max_pixels``), and the head runs in fp32 on the
  backbone's (bf16 in the authors' runs) hidden state. The head (3.7 M parameters, 15 MB) is
  kept in fp32, whole on every rank, outside the ZeRO-3 engine (an engine holds one dtype).
* ``unifiedreward``: UnifiedReward (Wang et al. 2025, CodeGoat24/UnifiedReward) scores a
  generated image pointwise by generating its answer to its authors' question
  (``inference_qwen/image_generation/qwen_point_score_image_generation.py``): key elements of the
  caption and ``Final Score:`` 1 to 5. Its authors call ``generate`` with ``max_new_tokens``
  only, so the model folder's ``generation_config.json`` decides how (Qwen2.5-VL-7B-Instruct's is
  top-k 1 sampling, i.e. greedy; that of ``CodeGoat24/UnifiedReward-qwen-7b``, the published
  Qwen2.5-VL-7B judge, was not read here; the UnifiedReward-2.0-qwen3vl judges, Qwen3-VL, take
  the same question in their classic mode), and they read the first integer after the last
  ``Final Score:`` (0 when none, ``DiffusionDPO/sift_dpo_data.py``); the reward is that grade
  divided by 5, in ``[0, 1]`` (as DiffusionNFT's UnifiedReward reward, whose question was not
  compared here). Under ZeRO-3 every rank keeps generating until every
  rank is done (transformers' ``synced_gpus``), so a sharded judge's forwards stay in lockstep.
  Not differentiable (the answer is text).
* ``unifiedreward_video``: the same judge shown a whole clip, as its authors' pointwise
  video-generation assessment (``inference_qwen/video_generation/qwen_point_score_video_generation.py``):
  the chat [video, question] (five dimensions graded 1 to 4, then ``Final Score:`` 1 to 10), the
  clip as Qwen2-VL's *video* input (``<|video_pad|>`` tokens, ``pixel_values_videos``,
  ``video_grid_thw`` and Qwen2.5-VL's ``second_per_grid_ts``; frames sampled and resized as
  qwen-vl-utils' ``fetch_video`` does, ``rewards.videos``), ``generate(max_new_tokens=1024)``. The
  script prints the answer; its authors read a 1-10 grade as ``parse_final_score`` does
  (``VideoDPO/sift_dpo_data.py``), here divided by 10, in ``[0, 1]``. Qwen2-VL and Qwen2.5-VL
  (Qwen3-VL's video chat carries timestamps in text; not built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .builtin import QWEN_VL_CHAT, QWEN_VL_IMAGE_TOKEN, VLMJudge, _processor_dict, load_vlm
from .images import QwenVLImageConfig, check_prompts, pack_rows, unpack_rows
from .videos import QwenVLVideoConfig, check_videos, qwen_vl_video_patches

# ------------------------------------------------------------------ HPSv3

# hpsv3/dataset/data_collator_qwen.py: INSTRUCTION (its {text_prompt} written {prompt} here) and
# prompt_with_special_token, which inference.py appends to it.
HPSV3_INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a"
    " overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the"
    " worst and 10 being the best. \n\n**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as"
    " abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to"
    " interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual"
    " elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme,"
    " composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense"
    " of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or"
    " adult material. If such content is present, the image quality and satisfaction score should be the lowest"
    " possible. \n\n**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object)"
    " align with the textual description. The subject should match the description in terms of number,"
    " appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well"
    " the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image"
    " logically fit the scenario described in the prompt. The environment should support and enhance the"
    " subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing,"
    " accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be"
    " acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the"
    " image. The generated content should not introduce elements that conflict with or distort the original"
    " description.\nTextual prompt - {prompt}\n\n\n"
)
HPSV3_REWARD_TOKEN = "<|Reward|>"
HPSV3_QUESTION = (
    HPSV3_INSTRUCTION + f"\nPlease provide the overall ratings of this image: {HPSV3_REWARD_TOKEN}\n\nEND\n"
)
HPSV3_PIXELS = 256 * 28 * 28  # inference.py: min_pixels = max_pixels = 256 * 28 * 28 per image
HPSV3_HEAD = "rm_head"
# the published head: nn.Sequential(Linear, ReLU, Dropout(0.05), Linear, ReLU, Linear); its Linears
HPSV3_HEAD_LINEARS = (0, 3, 5)


HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"  # the model HPSv3 fine-tunes: its config, tokenizer, processor
HPSV3_CHECKPOINT = ("MizzenAI/HPSv3", "HPSv3.safetensors")  # the published weights: one file


def write_hpsv3_folder(
    folder: str | os.PathLike,
    checkpoint: str | os.PathLike | None = None,
    base: str | os.PathLike = HPSV3_BASE,
) -> Path:
    """Write the folder ``HPSv3.from_pretrained`` reads from the published checkpoint, which is
    one safetensors file: ``base``'s config (its vocabulary resized to the tokenizer with
    ``<|Reward|>``, as HPSv3's ``create_model_and_processor`` resizes it), tokenizer (with
    ``<|Reward|>`` added) and image processor config, and ``checkpoint`` linked as
    ``model.safetensors`` (copied where links are refused).

    Args:
        folder: where to write (created).
        checkpoint: HPSv3's ``HPSv3.safetensors`` (default: downloaded from ``MizzenAI/HPSv3``).
        base: the Qwen2-VL it was trained from (a folder or hub id).

    Returns:
        ``folder``, for ``--reward_model hpsv3=FOLDER``.

    Not a collective: write it once, before the run.

    Example:
        >>> write_hpsv3_folder("/models/hpsv3")  # then --reward hpsv3 --reward_model hpsv3=/models/hpsv3
    """
    import json
    import shutil

    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if checkpoint is None:
        from huggingface_hub import hf_hub_download

        checkpoint = hf_hub_download(*HPSV3_CHECKPOINT)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(
        [AddedToken(HPSV3_REWARD_TOKEN, special=True, normalized=False)], special_tokens=True
    )
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = len(tokenizer)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(_processor_dict(base), indent=2))
    target = folder / "model.safetensors"
    target.unlink(missing_ok=True)
    try:
        target.symlink_to(Path(checkpoint).resolve())
    except OSError:
        shutil.copyfile(checkpoint, target)
    return folder


def hpsv3_head(widths: tuple[int, ...]) -> nn.Sequential:
    """HPSv3's ``ranknet`` head of ``widths`` (published: ``(3584, 1024, 16, 2)``), with its
    module names (``rm_head.0``, ``.3``, ``.5``), in fp32 and eval mode."""
    d, h1, h2, out = widths
    layers = [nn.Linear(d, h1), nn.ReLU(), nn.Dropout(0.05), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, out)]
    return nn.Sequential(*layers).float().eval()


def load_hpsv3_head(path: str | os.PathLike) -> nn.Sequential:
    """The ``rm_head.*`` tensors of the model folder ``path`` (in its safetensors weights, beside
    the Qwen2-VL's, as HPSv3 saves them) as an fp32 ``hpsv3_head``. Not a collective: the head
    is small and read whole.

    Raises:
        ValueError: the weights hold no head, or not the published head's layers.
    """
    from safetensors import safe_open

    from ..state.pretrained import resolve_model_folder, weight_files

    folder = resolve_model_folder(path)
    files = {k: f for k, f in weight_files(folder).items() if k.startswith(f"{HPSV3_HEAD}.")}
    expected = {f"{HPSV3_HEAD}.{i}.{kind}" for i in HPSV3_HEAD_LINEARS for kind in ("weight", "bias")}
    if set(files) != expected:
        raise ValueError(
            f"hpsv3 reward weights {folder}: expected the head's tensors {sorted(expected)}, found"
            f" {sorted(files) or 'none'} (HPSv3's checkpoint holds rm_head.* beside the Qwen2-VL)"
        )
    state = {}
    for key, file in files.items():
        with safe_open(str(file), framework="pt") as f:
            state[key.removeprefix(f"{HPSV3_HEAD}.")] = f.get_tensor(key).float()
    weights = [state[f"{i}.weight"] for i in HPSV3_HEAD_LINEARS]
    head = hpsv3_head((weights[0].shape[1], *(w.shape[0] for w in weights)))
    head.load_state_dict(state)
    return head


class _HeadReportFilter(logging.Filter):
    """Drops transformers' load report when the only keys it reports unexpected are the head's,
    which the Qwen2-VL class does not hold and ``load_hpsv3_head`` reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        rows = [line for line in record.getMessage().splitlines() if "UNEXPECTED" in line and "|" in line]
        return not rows or not all(f"{HPSV3_HEAD}." in line for line in rows)


@contextlib.contextmanager
def _head_keys_not_reported() -> Iterator[None]:
    """Within it, ``from_pretrained`` does not report the ``rm_head.*`` tensors as unexpected."""
    logger = logging.getLogger("transformers.modeling_utils")
    head_filter = _HeadReportFilter()
    logger.addFilter(head_filter)
    try:
        yield
    finally:
        logger.removeFilter(head_filter)


class HPSv3(VLMJudge):
    """HPSv3's score: the mu of its fp32 head on the Qwen2-VL's last hidden state at the
    ``<|Reward|>`` token of its instruction about the image and the prompt (see the module
    docstring), one forward, differentiable in the pixels.

    Rows as ``VLMJudge``'s (left-padded; the text positions count the real tokens only, so the
    padding changes nothing).

    Args:
        model: a ``Qwen2VLForConditionalGeneration`` whose vocabulary has ``<|Reward|>``.
        head: the fp32 head (``load_hpsv3_head``); kept whole, outside the module's parameters.
        tokenizer: its tokenizer, with ``<|Reward|>``.
        image_config: its image processor's steps (the pixel count HPSv3's, ``HPSV3_PIXELS``).
    """

    name = "hpsv3"

    def __init__(self, model: nn.Module, head: nn.Module, tokenizer: Any, image_config: QwenVLImageConfig):
        super().__init__(
            model, tokenizer, image_config, question=HPSV3_QUESTION, answers=None, template=QWEN_VL_CHAT
        )
        reward_ids = tokenizer.encode(HPSV3_REWARD_TOKEN, add_special_tokens=False)
        if len(reward_ids) != 1:
            raise ValueError(
                f"the hpsv3 reward's tokenizer must hold {HPSV3_REWARD_TOKEN} as one token (HPSv3 adds it to"
                f" Qwen2-VL's), it is {len(reward_ids)}: {reward_ids}"
            )
        self.reward_token_id = reward_ids[0]
        # Not a submodule: a ZeRO-3 engine holds its parameters in one dtype, and the head is fp32
        # (the reference's rm_head.to(torch.float32)) beside a bf16 backbone.
        object.__setattr__(self, "head", head.float().eval().requires_grad_(False))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype | None = None,
        *,
        load_model: Callable[[type, str | os.PathLike, torch.dtype | None], nn.Module] | None = None,
    ) -> HPSv3:
        """Load a folder (or hub id): ``config.json`` (a Qwen2-VL's, its vocabulary with
        ``<|Reward|>``), its tokenizer (with ``<|Reward|>``) and image processor config, and the
        safetensors weights of the model and the head (``rm_head.*``; the published
        ``HPSv3.safetensors`` saved as ``model.safetensors``, in either of transformers' key
        layouts). The backbone in ``dtype`` (``load_model`` as ``VLMJudge.from_pretrained``), the
        head in fp32. Not a collective unless ``load_model`` is."""
        from transformers import AutoTokenizer

        local = Path(path)
        if (
            local.is_dir()
            and not (local / "config.json").is_file()
            and (local / HPSV3_CHECKPOINT[1]).is_file()
        ):
            raise ValueError(
                f"hpsv3 reward folder {local} holds the published {HPSV3_CHECKPOINT[1]} alone: write a folder"
                " the reward reads with diffusers_zero3.rewards.vlm_judges.write_hpsv3_folder(FOLDER,"
                f" '{local / HPSV3_CHECKPOINT[1]}') (Qwen2-VL-7B-Instruct's config, tokenizer and processor beside it)"
            )
        with _head_keys_not_reported():
            model = load_vlm(path, dtype, load_model)
        config = QwenVLImageConfig.from_processor_dict(_processor_dict(path))
        config = dataclasses.replace(config, min_pixels=HPSV3_PIXELS, max_pixels=HPSV3_PIXELS)
        return cls(model, load_hpsv3_head(path), AutoTokenizer.from_pretrained(path), config)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` (HPSv3's mu, float32) of packed rows (``preprocess``)."""
        ints, floats = unpack_rows(rows)
        b = len(rows)
        gh, gw, length = (int(v) for v in ints[0, :3])
        ids, mask = ints[:, 3 : 3 + length], ints[:, 3 + length : 3 + 2 * length]
        grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long, device=rows.device)
        # sequential text positions, as the reference's decoder call without input_ids gives them
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            pixel_values=floats.reshape(b * gh * gw, -1),
            image_grid_thw=grid,
        ).last_hidden_state
        at_reward = ids == self.reward_token_id
        if not bool((at_reward.sum(-1) == 1).all()):
            raise ValueError(f"every hpsv3 row must hold {HPSV3_REWARD_TOKEN} once (a prompt holding it?)")
        head = self.head.to(hidden.device)
        return head(hidden[at_reward].float())[:, 0]


# ------------------------------------------------------------------ UnifiedReward

# inference_qwen/image_generation/qwen_point_score_image_generation.py: the pointwise question
# (its f-string's {prompt} kept as the placeholder)
UNIFIEDREWARD_QUESTION = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this"
    " image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with"
    " the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as"
    " described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including"
    " clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from"
    " the provided text caption, evaluate their presence in the generated image using the format: 'element"
    " (type): value' (where value=0 means not generated, and value=1 means generated), and assign a score from"
    " 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
UNIFIEDREWARD_MAX_NEW_TOKENS = 512  # the authors' pointwise script
# Qwen3-VL's chat template rendered for one user turn [image, text] with the generation prompt:
# unlike Qwen2-VL's, no default system turn.
QWEN3_VL_CHAT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
UNIFIEDREWARD_SCALE = 5.0  # its grades 1 to 5


def parse_final_score(answer: str) -> int:
    """The authors' reading of an answer: the first integer after its last ``Final Score:``
    (the whole answer when it has none), 0 when there is none.

    Example:
        >>> parse_final_score("red (color): 1\\nFinal Score: 4")
        4
        >>> parse_final_score("I cannot tell.")
        0
    """
    found = re.findall(r"\d+", answer.split("Final Score:")[-1].strip())
    return int(found[0]) if found else 0


class GradedAnswers:
    """A judge whose score is the grade it writes: the first integer after the last ``Final
    Score:`` of each generated answer (``parse_final_score``) over ``scale``. A subclass sets
    ``scale`` and builds each call's inputs; ``generate_answers`` runs the model on them."""

    scale: float

    def generate_answers(self, inputs: dict[str, torch.Tensor], length: int) -> list[str]:
        """The answers generated after the ``length`` tokens of the chat in ``inputs`` (special
        tokens skipped), one per row. Collective when the model is partitioned (every rank
        generates until all are done)."""
        generated = self.model.generate(
            **inputs,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad_id,
            synced_gpus=_partitioned_across_ranks(self.model),
        )
        return self.tokenizer.batch_decode(
            generated[:, length:], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` in ``[0, 1]`` (float32) of packed rows (``preprocess``)."""
        grades = [parse_final_score(a) for a in self.answers(rows)]
        return torch.tensor(grades, dtype=torch.float32, device=rows.device) / self.scale


class UnifiedReward(GradedAnswers, VLMJudge):
    """A UnifiedReward judge's pointwise grade divided by 5: the answer generated to its
    authors' question (see the module docstring), read by ``parse_final_score``.

    Rows as ``VLMJudge``'s. The generation follows the model folder's generation config (the
    authors pass only ``max_new_tokens``); under ZeRO-3 every rank steps until all are done.

    Args:
        model: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL judge (the published UnifiedReward-qwen-7b
            is a ``Qwen2_5_VLForConditionalGeneration``; UnifiedReward-2.0-qwen3vl-* are
            Qwen3-VL, whose chat has no default system turn), each with its own chat template.
        tokenizer: its tokenizer.
        image_config: its image processor's steps.
        question: the question, ``{prompt}`` standing for the image's prompt.
        max_new_tokens: the longest answer (the authors' 512).
    """

    name = "unifiedreward"
    scale = UNIFIEDREWARD_SCALE
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    model_kinds = "a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        image_config: QwenVLImageConfig,
        question: str = UNIFIEDREWARD_QUESTION,
        max_new_tokens: int = UNIFIEDREWARD_MAX_NEW_TOKENS,
    ):
        template = QWEN3_VL_CHAT if model.config.model_type == "qwen3_vl" else QWEN_VL_CHAT
        super().__init__(model, tokenizer, image_config, question=question, answers=None, template=template)
        self.max_new_tokens = int(max_new_tokens)

    def answers(self, rows: torch.Tensor) -> list[str]:
        """The generated answers of packed rows (special tokens skipped), one per row.

        Collective when the model is partitioned (every rank generates until all are done)."""
        ints, floats = unpack_rows(rows)
        b = len(rows)
        gh, gw, length = (int(v) for v in ints[0, :3])
        ids, mask = ints[:, 3 : 3 + length], ints[:, 3 + length : 3 + 2 * length]
        grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long, device=rows.device)
        inputs = dict(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=floats.reshape(b * gh * gw, -1),
            image_grid_thw=grid,
            mm_token_type_ids=(ids == self.image_token_id).long(),
        )
        return self.generate_answers(inputs, length)


# ------------------------------------------------------------------ UnifiedReward on clips

# inference_qwen/video_generation/qwen_point_score_video_generation.py: the pointwise question about
# a generated video (its f-string's {prompt} kept as the placeholder)
UNIFIEDREWARD_VIDEO_QUESTION = (
    "Suppose you are an expert in judging and evaluating the quality of AI-generated videos, please watch the"
    " frames of a given video and see the text prompt for generating the video.\nThen give scores from 5"
    " different dimensions:\n(1) visual quality: the quality of the video in terms of clearness, resolution,"
    " brightness, and color\n(2) temporal consistency, the consistency of objects or humans in video\n(3)"
    " dynamic degree, the degree of dynamic changes\n(4) text-to-video alignment, the alignment between the"
    " text prompt and the video content\n(5) factual consistency, the consistency of the video content with"
    " the common-sense and factual knowledge\n\nFor each dimension, output a number from [1,2,3,4], \nin which"
    " '1' means 'Bad', '2' means 'Average', '3' means 'Good', \n'4' means 'Real' or 'Perfect' (the video is"
    " like a real video)\nFinally, based on above 5 dimensions, assign a score from 1 to 10 after 'Final"
    " Score:'\nHere is an output example:\nvisual quality: 4\ntemporal consistency: 4\ndynamic degree:"
    " 3\ntext-to-video alignment: 1\nfactual consistency: 2\nFinal Score: 6\n\n**Note: In the example above,"
    " scores are placeholders meant only to demonstrate the format. Your actual evaluation should be based on"
    " the quality of the given video.**\nYour task is provided as follows: Text Prompt: [{prompt}]"
)
UNIFIEDREWARD_VIDEO_MAX_NEW_TOKENS = 1024  # the authors' video script
UNIFIEDREWARD_VIDEO_SCALE = 10.0  # its final grades 1 to 10
QWEN_VL_VIDEO_TOKEN = "<|video_pad|>"
# Qwen2-VL's and Qwen2.5-VL's chat template rendered for one user turn [video, text]
QWEN_VL_VIDEO_CHAT = QWEN_VL_CHAT.replace(QWEN_VL_IMAGE_TOKEN, QWEN_VL_VIDEO_TOKEN)
_VIDEO_HEADER = 5  # grid_t, grid_h, grid_w, chat length, the clip's frame count


class UnifiedRewardVideo(GradedAnswers, VLMJudge):
    """A UnifiedReward judge's pointwise grade of a whole clip divided by 10: the answer generated
    to its authors' video question (see the module docstring), read by ``parse_final_score``.

    Rows (``preprocess``): a header (the video grid, the chat's length and the clip's frame
    count, from which the sampled frame rate follows), the chat's token ids and attention mask
    (left-padded, ``<|video_pad|>`` repeated once per merged patch of the video) and the video's
    patches (``rewards.videos.qwen_vl_video_patches``), packed by ``images.pack_rows``. Every clip
    of a call has the same shape, so one grid serves every row.

    Args:
        model: a Qwen2-VL or Qwen2.5-VL judge (the published UnifiedReward-qwen-7b is a
            ``Qwen2_5_VLForConditionalGeneration``).
        tokenizer: its tokenizer.
        image_config: its processor's patching, normalisation and pixel range (the video
            processor's, which reads the same ``preprocessor_config.json``).
        video_config: the frames sampled and their size (qwen-vl-utils' defaults; ``video_fps``
            the clips' frame rate).
        question: the question, ``{prompt}`` standing for the clip's prompt.
        max_new_tokens: the longest answer (the authors' 1024).
    """

    name = "unifiedreward_video"
    scale = UNIFIEDREWARD_VIDEO_SCALE
    takes_videos = True
    model_types = ("qwen2_vl", "qwen2_5_vl")
    model_kinds = "a Qwen2-VL or Qwen2.5-VL model (Qwen3-VL's video chat is not built)"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        image_config: QwenVLImageConfig,
        video_config: QwenVLVideoConfig | None = None,
        question: str = UNIFIEDREWARD_VIDEO_QUESTION,
        max_new_tokens: int = UNIFIEDREWARD_VIDEO_MAX_NEW_TOKENS,
    ):
        super().__init__(
            model, tokenizer, image_config, question=question, answers=None, template=QWEN_VL_VIDEO_CHAT
        )
        self.video_config = video_config or QwenVLVideoConfig()
        self.video_token_id = int(model.config.video_token_id)
        self.max_new_tokens = int(max_new_tokens)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype | None = None,
        *,
        load_model: Callable[[type, str | os.PathLike, torch.dtype | None], nn.Module] | None = None,
        video_fps: float | None = None,
        **kwargs: Any,
    ) -> UnifiedRewardVideo:
        """``VLMJudge.from_pretrained``; ``video_fps`` (the clips' frame rate) replaces
        ``video_config``'s (default: ``QwenVLVideoConfig()``'s 16). Not a collective unless
        ``load_model`` is."""
        if video_fps is not None:
            kwargs["video_config"] = dataclasses.replace(
                kwargs.get("video_config") or QwenVLVideoConfig(), video_fps=float(video_fps)
            )
        return super().from_pretrained(path, dtype, load_model=load_model, **kwargs)

    def chat(self, prompt: str, video_tokens: int) -> str:
        """The text of one clip: the template around the question about ``prompt``, the video
        placeholder repeated ``video_tokens`` times."""
        text = self.template.replace("{question}", self.question.replace("{prompt}", prompt))
        return text.replace(QWEN_VL_VIDEO_TOKEN, QWEN_VL_VIDEO_TOKEN * video_tokens)

    def preprocess(self, videos: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``videos`` (float ``[B, F, 3, H, W]`` in ``[0, 1]``, ``F >= 2``,
        on the accelerator's device) and ``prompts``, on the videos' device."""
        check_videos(videos, self.name)
        check_prompts(self.name, videos, prompts, "clip")
        if not len(videos):
            return torch.zeros(0, 1, device=videos.device)  # no forward is made for them
        video = qwen_vl_video_patches(videos, self.image_config, self.video_config)
        gt, gh, gw = video.grid
        encoded = self.tokenizer(
            [self.chat(p, gt * gh * gw // self.image_config.merge_size**2) for p in prompts]
        )
        encoded = encoded["input_ids"]
        length, device = max(len(e) for e in encoded), videos.device
        ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), length), dtype=torch.long, device=device)
        for i, e in enumerate(encoded):
            ids[i, length - len(e) :] = torch.tensor(e, dtype=torch.long, device=device)
            mask[i, length - len(e) :] = 1
        header = torch.tensor(
            [[gt, gh, gw, length, videos.shape[1]]] * len(prompts), dtype=torch.long, device=device
        )
        return pack_rows(torch.cat([header, ids, mask], dim=1), video.patches.reshape(len(prompts), -1))

    def video_inputs(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword inputs of packed rows: ``input_ids``, ``attention_mask``,
        ``pixel_values_videos``, ``video_grid_thw``, ``mm_token_type_ids`` (2 at the video's
        tokens) and, for Qwen2.5-VL, ``second_per_grid_ts`` (its processor's ``2 / sampled fps``)."""
        ints, floats = unpack_rows(rows)
        b, device = len(rows), rows.device
        gt, gh, gw, length, frames = (int(v) for v in ints[0, :_VIDEO_HEADER])
        ids = ints[:, _VIDEO_HEADER : _VIDEO_HEADER + length]
        mask = ints[:, _VIDEO_HEADER + length : _VIDEO_HEADER + 2 * length]
        inputs = dict(
            input_ids=ids,
            attention_mask=mask,
            pixel_values_videos=floats.reshape(b * gt * gh * gw, -1),
            video_grid_thw=torch.tensor([[gt, gh, gw]] * b, dtype=torch.long, device=device),
            mm_token_type_ids=(ids == self.video_token_id).long() * 2,
        )
        if self.model.config.model_type == "qwen2_5_vl":
            # a float32 tensor of Python floats, as the processor's BatchFeature makes it: its
            # temporal positions are (t * tokens_per_second * this).long(), rounding included
            seconds = self.image_config.temporal_patch_size / self.video_config.sampled_fps(frames)
            inputs["second_per_grid_ts"] = torch.tensor([seconds] * b, dtype=torch.float32, device=device)
        return inputs

    def answers(self, rows: torch.Tensor) -> list[str]:
        """The generated answers of packed rows (special tokens skipped), one per row.

        Collective when the model is partitioned (every rank generates until all are done)."""
        inputs = self.video_inputs(rows)
        return self.generate_answers(inputs, inputs["input_ids"].shape[1])


def _partitioned_across_ranks(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitions in a group of several ranks: then a
    rank that has finished generating must keep calling forwards for the others."""
    from ..runtime.zero3 import is_zero3_param

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return torch.distributed.get_world_size() > 1 and any(is_zero3_param(p) for p in model.parameters())
