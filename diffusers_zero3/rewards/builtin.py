"""The built-in reward models, each an ``nn.Module`` built from transformers classes.

Each has ``preprocess(images, prompts)`` (its processor's work on the image tensor, on its
device: see ``rewards.images``) and ``forward(rows) -> scores [B]``, which is what
``ParallelReward`` calls per micro-batch, and a ``from_pretrained`` of a local folder or hub
id. Every model call happens inside the forward of the module or of its submodules, so that a
ZeRO-3 inference engine gathers each layer's parameters on the way (a parameter read outside
a forward would be an empty partition). None imports its authors' packages.

Each score is on the scale of the RL reference named beside it, so that a weight copied from
its config (DiffusionNFT's ``{pickscore: 1, hpsv2: 1, clipscore: 1}``) means the same here
(the references: yifan123/flow_grpo and NVlabs/DiffusionNFT, files under ``flow_grpo/``).

* ``pickscore``: PickScore (Kirstain et al. 2023), a CLIP-H fine-tuned on Pick-a-Pic, as
  flow_grpo's and DiffusionNFT's ``flow_grpo/pickscore_scorer.py`` score it:
  ``logit_scale.exp() * cos(text, image) / 26`` (about 0.8 for the published weights, whose
  logits sit near 21). Weights: ``yuvalkirstain/PickScore_v1`` with the processor of
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (taken from there when the model folder has none).
* ``pickscore_logit``: the same model's logit ``logit_scale.exp() * cos(text, image)``, as the
  authors' inference code (yuvalkirstain/PickScore, README) computes it: 26 times ``pickscore``.
* ``clip_score``: CLIP's cosine as DiffusionNFT's ``flow_grpo/clip_scorer.py`` scores it:
  ``logits_per_image.diagonal() / 100`` = ``logit_scale.exp() / 100 * cos(text, image)``, the
  cosine itself for OpenAI's CLIPs (their ``logit_scale.exp()`` is 100), not clamped. Any CLIP,
  e.g. ``openai/clip-vit-large-patch14`` (DiffusionNFT's).
* ``clip_score_100``: CLIPScore as torchmetrics computes it per sample:
  ``100 * max(cos(text, image), 0)`` (Hessel et al. use 2.5 instead of 100).
* ``aesthetic``: the LAION aesthetic predictor (christophschuhmann/improved-aesthetic-predictor):
  the normalised CLIP ViT-L/14 image embedding through an MLP head. A folder with ``clip/``
  (a CLIP model and its processor config) and the head's weights
  (``aesthetic_head.safetensors``, or the published ``sac+logos+ava1-l14-linearMSE.pth``).
  The head's output as it is (about 1 to 10), as flow_grpo's and DiffusionNFT's
  ``flow_grpo/aesthetic_scorer.py``.
* ``vlm``: a Qwen2-VL / Qwen2.5-VL judge: ``P(Yes) / (P(Yes) + P(No))`` from the next-token
  logits of its answer to a question about the image and the prompt (``VLMJudge.question``),
  in ``[0, 1]``. Neither RL reference has it (their VLM judges, flow_grpo's ``qwenvl.py`` and
  DiffusionNFT's UnifiedReward in ``rewards.py``, parse a generated 1-5 grade and divide it by 5:
  also in ``[0, 1]``, but another judge and question).
* ``hpsv2``: HPSv2 / HPSv2.1 (tgxs002/HPSv2, ``img_score.py``): ``cos(text, image)`` of an
  open_clip ViT-H-14 fine-tuned on human preferences, its checkpoint converted to a
  ``CLIPModel`` (``rewards.hps``; open_clip is not needed), in ``[-1, 1]`` (about 0.25 to 0.3
  for the published weights), as DiffusionNFT's ``flow_grpo/hpsv2_scorer.py``. Weights:
  ``xswu/HPSv2``.
* ``imagereward``: ImageReward (Xu et al. 2023, THUDM/ImageReward): a BLIP text encoder
  cross-attending to the ViT's image tokens, its [CLS] feature through an MLP head,
  ``(mlp - mean) / std`` with the published constants, as the authors' ``ImageReward.score``
  (``rewards.imagereward``, on transformers' BLIP classes; the image-reward package is not
  needed), as flow_grpo's and DiffusionNFT's ``flow_grpo/imagereward_scorer.py`` (its
  ``inference_rank``, the same normalised score). Weights: ``THUDM/ImageReward``
  (``ImageReward.pt``, ``med_config.json``).
* ``hpsv3`` and ``unifiedreward``: VLM judges on their authors' scoring (``rewards.vlm_judges``):
  HPSv3's fp32 head on a Qwen2-VL-7B at its ``<|Reward|>`` token (HPSv3's scale, mu); a
  UnifiedReward Qwen2.5-VL's generated 1-5 grade after ``Final Score:``, divided by 5.
* ``unifiedreward_video``: a judge of whole clips (``takes_videos``): the same UnifiedReward
  Qwen2.5-VL shown the clip as its video input, its generated 1-10 grade after ``Final Score:``
  to its authors' video question, divided by 10 (``rewards.vlm_judges``, ``rewards.videos``).
* ``pairwise_vlm``: a group-wise reward (Pref-GRPO): a Qwen VL judge shown two images of a
  prompt's group, P(first better) from its answer's logits; each image's reward is its win rate
  in its group (``rewards.pairwise_judge``, ``rewards.groupwise``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .images import (
    ClipImageConfig,
    QwenVLImageConfig,
    check_images,
    check_prompts,
    clip_pixel_values,
    pack_rows,
    qwen_vl_patches,
    unpack_rows,
)

# The processor PickScore's authors load beside their model (its hub folder has none).
PUBLISHED_PROCESSORS = {"yuvalkirstain/PickScore_v1": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"}


def _processor_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The image processor config (``preprocessor_config.json``) of a folder or hub id."""
    from transformers.image_processing_utils import ImageProcessingMixin

    return ImageProcessingMixin.get_image_processor_dict(str(path))[0]


def _empty_rows(images: torch.Tensor) -> torch.Tensor:
    """The rows of a call with no samples (no forward is made for them)."""
    return torch.zeros(0, 1, device=images.device)


# ------------------------------------------------------------------ CLIP: PickScore, CLIPScore


class ClipTextImageReward(nn.Module):
    """A score of each (image, prompt) pair from a ``transformers.CLIPModel``.

    Rows (``preprocess``): the prompt's token ids and attention mask (padded to the longest
    prompt of the call, at most 77 tokens, as ``CLIPProcessor(padding=True, truncation=True)``)
    and the processor's ``pixel_values``, packed by ``images.pack_rows``. The forward runs
    ``CLIPModel.forward``, whose outputs hold both normalised embeddings and
    ``logit_scale.exp() * cos`` for every pair.

    Args:
        clip: the CLIP model.
        tokenizer: its tokenizer (``CLIPTokenizer``).
        image_config: its image processor's steps.
    """

    name = "clip"

    def __init__(self, clip: nn.Module, tokenizer: Any, image_config: ClipImageConfig):
        super().__init__()
        self.clip = clip
        self.tokenizer = tokenizer
        self.image_config = image_config
        size = image_config.output_size()
        if size is None:
            raise ValueError(
                f"{self.name}: the image processor must give a fixed size (a crop or a height/width)"
            )
        self.pixel_shape = (3, *size)
        self.max_length = min(
            int(tokenizer.model_max_length), int(clip.config.text_config.max_position_embeddings)
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype | None = None,
        processor_path: str | os.PathLike | None = None,
    ) -> ClipTextImageReward:
        """Load the CLIP model of ``path`` and its processor (tokenizer and image processor
        config) from ``processor_path`` (default: ``path``, or the processor its authors pair
        with published weights, ``PUBLISHED_PROCESSORS``).

        Not a collective; load inside ``zero3_init_disabled()`` to get the model whole.
        """
        from transformers import AutoTokenizer, CLIPModel

        processor_path = processor_path or PUBLISHED_PROCESSORS.get(str(path), path)
        clip = CLIPModel.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(processor_path)
        return cls(clip, tokenizer, ClipImageConfig.from_processor_dict(_processor_dict(processor_path)))

    def preprocess(self, images: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``images`` (float ``[B, 3, H, W]`` in ``[0, 1]``, on the
        accelerator's device) and ``prompts``, on the images' device."""
        check_images(images, self.name)
        prompts = check_prompts(self.name, images, prompts)
        if not len(images):
            return _empty_rows(images)
        text = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        ints = torch.cat([text["input_ids"], text["attention_mask"]], dim=1)
        pixels = clip_pixel_values(images, self.image_config)
        return pack_rows(ints, pixels.reshape(len(images), -1))

    def clip_output(self, rows: torch.Tensor) -> Any:
        """``CLIPModel.forward`` on packed rows: a ``CLIPOutput`` of the B x B pairs."""
        ints, floats = unpack_rows(rows)
        length = ints.shape[1] // 2
        return self.clip(
            input_ids=ints[:, :length],
            attention_mask=ints[:, length:],
            pixel_values=floats.reshape(len(rows), *self.pixel_shape),
        )


# flow_grpo's and DiffusionNFT's PickScoreScorer: ``scores = scores / 26`` ("norm to 0-1")
PICKSCORE_DIVISOR = 26.0
# DiffusionNFT's ClipScorer: ``outputs.logits_per_image.diagonal() / 100``
CLIP_SCORE_DIVISOR = 100.0


class PickScoreLogit(ClipTextImageReward):
    """PickScore's logit: ``logit_scale.exp() * cos(text_embedding, image_embedding)`` per pair,
    the diagonal of the CLIP logits (yuvalkirstain/PickScore README: ``model.logit_scale.exp() *
    (text_embs @ image_embs.T)`` of L2-normalised ``get_text_features`` /
    ``get_image_features``)."""

    name = "pickscore_logit"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of packed rows (``preprocess``)."""
        return self.clip_output(rows).logits_per_image.diagonal()


class PickScore(PickScoreLogit):
    """PickScore as flow_grpo and DiffusionNFT score it (``flow_grpo/pickscore_scorer.py``,
    ``PickScoreScorer``): the logit divided by 26, about 0.8 for the published weights."""

    name = "pickscore"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of packed rows (``preprocess``)."""
        return super().forward(rows) / PICKSCORE_DIVISOR


class ClipScore(ClipTextImageReward):
    """CLIP's text-image cosine as DiffusionNFT scores it (``flow_grpo/clip_scorer.py``,
    ``ClipScorer``): ``logits_per_image.diagonal() / 100``, i.e. ``logit_scale.exp() / 100 *
    cos(text_embedding, image_embedding)``: the cosine for OpenAI's CLIPs (``logit_scale.exp()``
    = 100), in ``[-1, 1]``, not clamped."""

    name = "clip_score"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of packed rows (``preprocess``)."""
        return self.clip_output(rows).logits_per_image.diagonal() / CLIP_SCORE_DIVISOR


class ClipScore100(ClipTextImageReward):
    """CLIPScore as torchmetrics' ``CLIPScore`` computes it per sample:
    ``100 * max(cos(text_embedding, image_embedding), 0)``, in ``[0, 100]``."""

    name = "clip_score_100"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of packed rows (``preprocess``)."""
        out = self.clip_output(rows)
        return 100 * (out.image_embeds * out.text_embeds).sum(-1).clamp(min=0)


# ------------------------------------------------------------------ LAION aesthetic predictor

AESTHETIC_HEAD_FILE = "aesthetic_head.safetensors"


class AestheticHead(nn.Module):
    """The MLP of LAION's improved aesthetic predictor (``simple_inference.py``'s ``MLP``),
    with its module names, so that the published state dict loads as it is.

    Args:
        input_size: the CLIP embedding width (768 for ViT-L/14).
    """

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``[B, 1]`` scores of ``[B, input_size]`` normalised embeddings."""
        return self.layers(embeddings)


class AestheticPredictor(nn.Module):
    """LAION's aesthetic score: a CLIP image embedding, L2-normalised (a zero vector left as
    it is, as the authors' ``normalized``), through ``AestheticHead``.

    Args:
        vision: a ``CLIPVisionModelWithProjection`` (its ``image_embeds`` are CLIP's
            ``encode_image``).
        head: the MLP head.
        image_config: the CLIP image processor's steps.
    """

    name = "aesthetic"

    def __init__(self, vision: nn.Module, head: AestheticHead, image_config: ClipImageConfig):
        super().__init__()
        self.vision = vision
        self.head = head
        self.image_config = image_config

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None) -> AestheticPredictor:
        """Load a folder: ``clip/`` (a CLIP or CLIP vision model with its
        ``preprocessor_config.json``) and the head, ``aesthetic_head.safetensors`` or one
        ``*.pth`` of LAION's (keys ``layers.N.weight``/``bias``). Not a collective."""
        from transformers import CLIPVisionModelWithProjection

        path = Path(path)
        if not (path / "clip").is_dir():
            raise FileNotFoundError(
                f"aesthetic reward folder {path} has no clip/ (the CLIP model and its processor)"
            )
        vision = CLIPVisionModelWithProjection.from_pretrained(path / "clip", dtype=dtype)
        state = _load_head_state(path)
        head = AestheticHead(state["layers.0.weight"].shape[1])
        head.load_state_dict(state)
        if dtype is not None:
            head.to(dtype)
        return cls(vision, head, ClipImageConfig.from_processor_dict(_processor_dict(path / "clip")))

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write the folder ``from_pretrained`` reads: ``clip/`` (the vision model and its
        processor config) and ``aesthetic_head.safetensors``. Not a collective."""
        from safetensors.torch import save_file

        path = Path(path)
        self.vision.save_pretrained(path / "clip")
        config = json.dumps(self.image_config.to_processor_dict(), indent=2)
        (path / "clip" / "preprocessor_config.json").write_text(config)
        save_file(
            {k: v.contiguous() for k, v in self.head.state_dict().items()}, str(path / AESTHETIC_HEAD_FILE)
        )
        return path

    def preprocess(self, images: torch.Tensor, prompts: Sequence[str] | None = None) -> torch.Tensor:
        """CLIP's ``pixel_values`` ``[B, 3, S, S]`` of ``images`` (float ``[B, 3, H, W]`` in
        ``[0, 1]``, on the accelerator's device); the prompts are not used."""
        check_images(images, self.name)
        return clip_pixel_values(images, self.image_config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of CLIP pixel values."""
        emb = self.vision(pixel_values=pixel_values).image_embeds
        norm = emb.norm(dim=-1, keepdim=True)
        emb = emb / torch.where(norm == 0, torch.ones_like(norm), norm)
        return self.head(emb).squeeze(-1)


def _load_head_state(path: Path) -> dict[str, torch.Tensor]:
    if (path / AESTHETIC_HEAD_FILE).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / AESTHETIC_HEAD_FILE))
    pth = sorted(path.glob("*.pth"))
    if len(pth) != 1:
        raise FileNotFoundError(
            f"aesthetic reward folder {path} needs {AESTHETIC_HEAD_FILE} or one *.pth of the head, found {len(pth)} *.pth"
        )
    return torch.load(pth[0], map_location="cpu", weights_only=True)


# ------------------------------------------------------------------ a VLM judge

DEFAULT_VLM_QUESTION = "Does this image match the prompt '{prompt}'? Answer Yes or No."
# Qwen2-VL's and Qwen2.5-VL's chat template rendered for one user turn (an image, then text)
# with the generation prompt, as their processors' apply_chat_template gives it.
QWEN_VL_CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_VL_IMAGE_TOKEN = "<|image_pad|>"
QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def load_vlm(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    load_model: Callable[[type, str | os.PathLike, torch.dtype | None], nn.Module] | None = None,
) -> nn.Module:
    """The model of ``path``, of the transformers class its config's ``architectures`` names,
    by ``cls.from_pretrained`` or ``load_model(cls, path, dtype)`` (the registry's partitioned
    load). Not a collective unless ``load_model`` is."""
    import transformers
    from transformers import AutoConfig

    architectures = AutoConfig.from_pretrained(path).architectures or []
    model_cls = getattr(transformers, architectures[0], None) if architectures else None
    if model_cls is None:
        raise ValueError(f"{path}: its config.json names no transformers model class (architectures)")
    if load_model is None:
        return model_cls.from_pretrained(path, dtype=dtype)
    return load_model(model_cls, path, dtype)


class VLMJudge(nn.Module):
    """A vision-language model's answer as a score: ``P(yes) / (P(yes) + P(no))`` of the next
    token after ``question`` (about the image and its prompt), from the logits of the last
    position only.

    Rows (``preprocess``): the grid of image patches, the chat's token ids and attention mask
    (left-padded to the longest of the call, the image placeholder expanded to one token per
    merged patch as Qwen2-VL's processor does) and the flattened patches, packed by
    ``images.pack_rows``.

    Args:
        model: a ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``
            (``AutoModelForImageTextToText`` gives either).
        tokenizer: its tokenizer.
        image_config: its image processor's steps.
        question: the question, ``{prompt}`` standing for the image's prompt.
        answers: the (yes, no) answers, each one token (None: a judge that scores otherwise).
        template: the chat around the question, ``{question}`` standing for it and
            ``<|image_pad|>`` for the image.
    """

    name = "vlm"
    model_types = QWEN_VL_MODEL_TYPES  # the model_type values it takes, and in words:
    model_kinds = "a Qwen2-VL or Qwen2.5-VL model"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        image_config: QwenVLImageConfig,
        question: str = DEFAULT_VLM_QUESTION,
        answers: tuple[str, str] | None = ("Yes", "No"),
        template: str = QWEN_VL_CHAT,
    ):
        super().__init__()
        if model.config.model_type not in self.model_types:
            raise ValueError(
                f"the {self.name} reward takes {self.model_kinds} (model_type {' or '.join(self.model_types)}),"
                f" got model_type {model.config.model_type!r}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.question, self.template = question, template
        self.image_token_id = int(model.config.image_token_id)
        ids = []
        for answer in answers or ():  # None: a judge scored otherwise (rewards.vlm_judges)
            tokens = tokenizer.encode(answer, add_special_tokens=False)
            if len(tokens) != 1:
                raise ValueError(
                    f"the vlm reward's answer {answer!r} must be one token, it is {len(tokens)}: {tokens}"
                )
            ids.append(tokens[0])
        self.yes_id, self.no_id = ids or (None, None)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype | None = None,
        *,
        load_model: Callable[[type, str | os.PathLike, torch.dtype | None], nn.Module] | None = None,
        **kwargs: Any,
    ) -> VLMJudge:
        """Load the model (the class its config's ``architectures`` names), tokenizer and image
        processor config of ``path``; ``kwargs`` go to the constructor (``question``,
        ``answers``, ``template``). ``load_model(cls, path, dtype)`` loads the model instead of
        ``cls.from_pretrained`` (the registry passes ``load_pretrained_zero3`` for a sharded
        judge: read straight into partitions, never whole on a rank). Not a collective unless
        ``load_model`` is."""
        from transformers import AutoTokenizer

        model = load_vlm(path, dtype, load_model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, QwenVLImageConfig.from_processor_dict(_processor_dict(path)), **kwargs)

    def chat(self, prompt: str, image_tokens: int) -> str:
        """The text of one sample: the template around the question about ``prompt``, the
        image placeholder repeated ``image_tokens`` times."""
        question = self.question.replace("{prompt}", prompt)
        text = self.template.replace("{question}", question)
        return text.replace(QWEN_VL_IMAGE_TOKEN, QWEN_VL_IMAGE_TOKEN * image_tokens)

    def preprocess(self, images: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``images`` (float ``[B, 3, H, W]`` in ``[0, 1]``, on the
        accelerator's device) and ``prompts``, on the images' device."""
        check_images(images, self.name)
        prompts = check_prompts(self.name, images, prompts)
        if not len(images):
            return _empty_rows(images)
        return self.pack_chats(images, prompts)

    def pack_chats(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Packed rows ``[B, D]``, one chat per prompt (``chat``, left-padded: the last position
        is every row's next token) with its images' patches: ``images`` holds ``len(images) //
        len(prompts)`` consecutive images per prompt (one here; two for a pairwise judge)."""
        patches, gh, gw = qwen_vl_patches(images, self.image_config)
        image_tokens = gh * gw // self.image_config.merge_size**2
        encoded = self.tokenizer([self.chat(p, image_tokens) for p in prompts])["input_ids"]
        length = max(len(e) for e in encoded)
        device = images.device
        ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), length), dtype=torch.long, device=device)
        for i, e in enumerate(encoded):
            ids[i, length - len(e) :] = torch.tensor(e, dtype=torch.long, device=device)
            mask[i, length - len(e) :] = 1
        header = torch.tensor([[gh, gw, length]] * len(prompts), dtype=torch.long, device=device)
        return pack_rows(torch.cat([header, ids, mask], dim=1), patches.reshape(len(prompts), -1))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` in ``[0, 1]`` of packed rows (``preprocess``)."""
        return self.first_answer_probability(rows)

    def first_answer_probability(self, rows: torch.Tensor) -> torch.Tensor:
        """``P(first answer) / (P(first) + P(second))`` ``[B]`` (float32) from the next-token
        logits of packed rows (``pack_chats``), each row's images in the same forward."""
        ints, floats = unpack_rows(rows)
        b = len(rows)
        gh, gw, length = (int(v) for v in ints[0, :3])
        ids, mask = ints[:, 3 : 3 + length], ints[:, 3 + length : 3 + 2 * length]
        per_row = (
            int((ids[0] == self.image_token_id).sum()) * self.image_config.merge_size**2 // (gh * gw)
        )  # images
        grid = torch.tensor([[1, gh, gw]] * (per_row * b), dtype=torch.long, device=rows.device)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=floats.reshape(per_row * b * gh * gw, -1),
            image_grid_thw=grid,
            mm_token_type_ids=(ids == self.image_token_id).long(),
            logits_to_keep=1,
        ).logits[:, -1]
        pair = logits[:, [self.yes_id, self.no_id]].float()
        return pair.softmax(dim=-1)[:, 0]


def _lazy(module: str, cls: str) -> Callable[..., nn.Module]:
    """``<module>.<cls>.from_pretrained(path, dtype, **options)``, the module imported when
    called (``hps``, ``imagereward`` and ``vlm_judges`` import this one)."""

    def load(path: str | os.PathLike, dtype: torch.dtype | None = None, **options: Any) -> nn.Module:
        from importlib import import_module

        return getattr(import_module(f"{__package__}.{module}"), cls).from_pretrained(path, dtype, **options)

    load.__name__ = load.__qualname__ = f"load_{cls}"
    return load


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class BuiltinReward:
    """A built-in reward name.

    Attributes:
        name: its ``--reward`` name.
        summary: what it scores, one line.
        published: the weights to pass as ``--reward_model NAME=...`` for the published model.
        load: ``load(path, dtype, **options) -> nn.Module`` with ``preprocess``/``forward``
            (``vlm`` takes ``question=``).
        dtype: the dtype its weights, inputs and score are in whatever the run's: float32, as
            the references score (flow_grpo and DiffusionNFT load their reward models in fp32).
            In bf16 PickScore's logits (~21, a ``pickscore`` of ~0.8) round in steps of 0.125 and HPSv2's cosines in
            steps of ~0.002, the size of the differences within a prompt's group; bf16 weights
            with an fp32 final score still err by a sizeable fraction of those differences
            (docs/rl.md, "Rewards in fp32"). None: the run's dtype (the ``vlm`` judge, a 7-72 B
            model; its yes/no probabilities are formed in fp32 from its logits).
        partitioned_load: ``load`` takes ``load_model=`` to read the weights straight into
            ZeRO-3 partitions under ``shard``/``offload`` (a 7-72 B judge, never whole on a rank).
        takes_question: ``load`` takes ``question=`` (``--vlm_question``).
        scope: ``"sample"``, or ``"pairwise"`` for a judge of two images whose reward is each
            image's win rate in its group (``rewards.groupwise``).
        takes_videos: the model scores whole clips: its ``preprocess`` takes videos
            ``[B, F, 3, H, W]`` in ``[0, 1]``. Every other reward scores a video through its
            frames (``rewards.registry.score_frames``: the chosen frames' mean).
    """

    name: str
    summary: str
    published: str
    load: Callable[..., nn.Module]
    dtype: torch.dtype | None = torch.float32
    partitioned_load: bool = False
    takes_question: bool = False
    scope: str = "sample"
    takes_videos: bool = False

    @property
    def needs_weights(self) -> bool:
        """Every built-in model reads its weights from ``--reward_model``."""
        return True


BUILTINS: dict[str, BuiltinReward] = {
    b.name: b
    for b in (
        BuiltinReward(
            "pickscore",
            "PickScore / 26, as flow_grpo and DiffusionNFT: logit_scale.exp() * cos(text, image) / 26 of a"
            " CLIP-H fine-tuned on Pick-a-Pic",
            "yuvalkirstain/PickScore_v1",
            PickScore.from_pretrained,
        ),
        BuiltinReward(
            "pickscore_logit",
            "PickScore's logit, as its authors' README: logit_scale.exp() * cos(text, image) (26 x pickscore)",
            "yuvalkirstain/PickScore_v1",
            PickScoreLogit.from_pretrained,
        ),
        BuiltinReward(
            "clip_score",
            "CLIP cosine, as DiffusionNFT: logits_per_image / 100 (cos(text, image) for OpenAI's CLIPs)",
            "openai/clip-vit-large-patch14",
            ClipScore.from_pretrained,
        ),
        BuiltinReward(
            "clip_score_100",
            "CLIPScore as torchmetrics: 100 * max(cos(text, image), 0)",
            "openai/clip-vit-large-patch14",
            ClipScore100.from_pretrained,
        ),
        BuiltinReward(
            "aesthetic",
            "LAION aesthetic predictor: MLP head on the normalised CLIP ViT-L/14 image embedding",
            "a folder with clip/ (openai/clip-vit-large-patch14) and sac+logos+ava1-l14-linearMSE.pth",
            AestheticPredictor.from_pretrained,
        ),
        BuiltinReward(
            "vlm",
            "VLM judge: P(Yes) / (P(Yes) + P(No)) of a Qwen2-VL / Qwen2.5-VL asked whether the image matches",
            "Qwen/Qwen2.5-VL-7B-Instruct",
            VLMJudge.from_pretrained,
            dtype=None,
            partitioned_load=True,
            takes_question=True,
        ),
        BuiltinReward(
            "hpsv2",
            "HPSv2: cos(text, image) of an open_clip ViT-H-14 fine-tuned on human preferences, as a CLIPModel"
            " (HPSv2.1: xswu/HPSv2/HPS_v2.1_compressed.pt)",
            "xswu/HPSv2",
            _lazy("hps", "HPSv2"),
        ),
        BuiltinReward(
            "imagereward",
            "ImageReward: (mlp - mean) / std of a BLIP text encoder's [CLS] feature, cross-attending to the image",
            "THUDM/ImageReward",
            _lazy("imagereward", "ImageRewardModel"),
        ),
        BuiltinReward(
            "hpsv3",
            "HPSv3: mu of an fp32 MLP head on a Qwen2-VL-7B's last hidden state at <|Reward|> after its"
            " instruction about the image and prompt",
            "MizzenAI/HPSv3 (in a folder from rewards.vlm_judges.write_hpsv3_folder: HPSv3.safetensors beside"
            " Qwen/Qwen2-VL-7B-Instruct's config, tokenizer and processor, <|Reward|> added)",
            _lazy("vlm_judges", "HPSv3"),
            dtype=None,
            partitioned_load=True,
        ),
        BuiltinReward(
            "unifiedreward",
            "UnifiedReward: the 1-5 grade after 'Final Score:' in a Qwen2.5-VL judge's generated answer"
            " to its authors' pointwise question, / 5",
            "CodeGoat24/UnifiedReward-qwen-7b",
            _lazy("vlm_judges", "UnifiedReward"),
            dtype=None,
            partitioned_load=True,  # its question is its authors' (--vlm_question is the vlm judge's)
        ),
        BuiltinReward(
            "unifiedreward_video",
            "UnifiedReward on a whole clip: the 1-10 grade after 'Final Score:' in a Qwen2.5-VL judge's generated"
            " answer to its authors' pointwise video question, / 10 (the clip as the model's video input)",
            "CodeGoat24/UnifiedReward-qwen-7b",
            _lazy("vlm_judges", "UnifiedRewardVideo"),
            dtype=None,
            partitioned_load=True,
            takes_videos=True,
        ),
        BuiltinReward(
            "pairwise_vlm",
            "Pref-GRPO's pairwise reward: each image's win rate over the other members of its prompt's group,"
            " P(Image 1 better) from a Qwen2-VL / Qwen2.5-VL judge's answer logits, both orders of each pair",
            "CodeGoat24/UnifiedReward-qwen-7b (any Qwen2-VL / Qwen2.5-VL)",
            _lazy("pairwise_judge", "PairwiseVLMJudge"),
            dtype=None,
            partitioned_load=True,
            scope="pairwise",
        ),
    )
}


def describe_builtins() -> str:
    """One line per built-in reward: name, summary, published weights (for ``--help``)."""
    return "\n".join(f"{b.name}: {b.summary} (weights: {b.published})" for b in BUILTINS.values())
