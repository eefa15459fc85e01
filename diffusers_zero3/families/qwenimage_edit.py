"""Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509): instruction
editing, source image(s) + instruction -> target image, on Qwen-Image's transformer and VAE
(``qwenimage.py``).

Two differences from Qwen-Image:

- The frozen Qwen2.5-VL *sees the source images*: the prompt template holds one
  ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` per source before the instruction,
  each source is resized to about 384 x 384 (``CONDITION_IMAGE_AREA``, the pipeline's
  ``calculate_dimensions``), turned into Qwen2-VL patches by the image processor, and its
  ``<|image_pad|>`` expanded to one token per merged patch; the conditioning is the last hidden
  states after the first 64 tokens (the system prompt), image tokens included. So the text
  encoder cannot be cached, and its vision tower runs.
- The sources' latents (the VAE's mode, normalised as the target's), 2x2-packed, follow the
  target's noisy tokens, ``img_shapes`` lists the target and each source, and the prediction is
  read off the target's tokens alone, as the pipeline's loop does.

The trainer's sources are the pairs' sources cropped as their target (``data.pairs``); the
pipeline encodes its sources' latents at a 1024 x 1024 area, which validation sets to the
generated size (``prepare_validation_pipeline``) so that it sees what training saw.

Without torchvision, transformers' ``Qwen2VLProcessor`` cannot be built (its video processor
needs it): ``Qwen2VLImageTextProcessor`` (this module) is the processor without the video
part (``Qwen2VLImageProcessorPil`` and the tokenizer), which the tiny pipeline saves and any
``processor`` folder loads into.
"""

from __future__ import annotations

import functools

import torch

from ..runtime.library_internals import qwenimage_edit_plus_source_area
from .common import llm_text_encoder
from .kontext import EDIT_VALIDATION_ARGS
from .qwenimage import (
    QWENIMAGE,
    QwenImage,
    pack_latents,
    unpack_latents,
)

# QwenImageEditPlusPipeline.prompt_template_encode / prompt_template_encode_start_idx
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
DROPPED_TEMPLATE_TOKENS = 64
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # one per source image
PICTURE_TOKENS = 8  # "Picture", " ", "k", ":", " " and the three vision tokens (checked by the tests)
MAX_SOURCES = 3  # the template's picture blocks; Qwen-Image-Edit-2509 is made for 1 to 3 sources
CONDITION_IMAGE_AREA = 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE
PROCESSOR_CLASS = "Qwen2VLImageTextProcessor"


def condition_size(width: int, height: int) -> tuple[int, int]:
    """``(width, height)`` the pipeline resizes a source of that size to before the VL's image
    processor: ``calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    return calculate_dimensions(CONDITION_IMAGE_AREA, width / height)


@functools.lru_cache(maxsize=4)
def image_processor(patch_size: int, merge_size: int, temporal_patch_size: int):
    """Qwen2-VL's image processor (PIL backend: no torchvision) at the published defaults (CLIP
    mean and std, pixel bounds) and the vision tower's patching."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size
    )


def condition_images(sources: torch.Tensor) -> list:
    """The PIL images the pipeline hands Qwen2.5-VL for sources ``(N, K, 3, H, W)`` in [-1, 1]:
    each back to 8 bits (the pixels a dataset made of an 8-bit image, exactly), resized with the
    pipeline's ``VaeImageProcessor.resize`` (Lanczos) to ``condition_size``; sample by sample."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    resize = VaeImageProcessor().resize
    pixels = ((sources.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    images = []
    for image in pixels.flatten(0, 1):
        pil = Image.fromarray(image.permute(1, 2, 0).numpy())
        width, height = condition_size(pil.width, pil.height)
        images.append(resize(pil, height, width))
    return images


def vision_inputs(
    config, input_ids: torch.Tensor, attention_mask: torch.Tensor, sources: torch.Tensor
) -> dict:
    """What ``QwenImageEditPlusPipeline``'s processor call gives Qwen2.5-VL for the template ids
    of ``tokenize`` (``MAX_SOURCES`` picture blocks) and sources ``(N, K, 3, H, W)``: each
    row's valid ids with blocks ``K + 1 ..`` removed and each ``<|image_pad|>`` expanded to its
    image's merged patches, right-padded to the longest row; the images' ``pixel_values`` and
    ``image_grid_thw`` (row by row, source by source). ``config`` is the encoder's."""
    n, k = sources.shape[:2]
    if not 1 <= k <= MAX_SOURCES:
        raise ValueError(f"Qwen-Image-Edit takes 1 to {MAX_SOURCES} source images per target, not {k}")
    vision = config.vision_config
    processor = image_processor(vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    images = condition_images(sources) if n else []
    if images:
        processed = processor(images=images, return_tensors="pt")
        pixel_values, grid = processed["pixel_values"], processed["image_grid_thw"]
    else:  # a rank without samples
        pixel_values, grid = None, None
    counts = [] if grid is None else (grid.prod(dim=-1) // vision.spatial_merge_size**2).tolist()
    end, pad = config.vision_end_token_id, config.image_token_id
    rows = []
    for r in range(n):
        ids = input_ids[r][attention_mask[r].bool()].tolist()
        ends = [i for i, t in enumerate(ids) if t == end][:MAX_SOURCES]
        if len(ends) != MAX_SOURCES:
            raise ValueError(
                "the token ids do not hold the template's picture blocks: tokenize them with this family"
            )
        ids = ids[: ends[k - 1] + 1] + ids[ends[-1] + 1 :]  # the first K picture blocks
        out, image = [], r * k
        for t in ids:
            if t == pad:
                out.extend([pad] * counts[image])
                image += 1
            else:
                out.append(t)
        rows.append(out)
    length = max((len(r) for r in rows), default=input_ids.shape[1])
    # CPU: token ids as the tokenizer's; encode_texts moves them to the encoder's device
    ids = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.long)  # CPU: as the ids
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)  # CPU: as the ids
        mask[r, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values, "image_grid_thw": grid}


def processor_class():
    """``Qwen2VLImageTextProcessor``: transformers' ``Qwen2VLProcessor`` without its video
    processor (which needs torchvision): an image processor and a tokenizer. Loads a published
    ``processor`` folder (its video config is ignored) and saves one."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` for images and text only (no torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    Qwen2VLImageTextProcessor.__module__ = __name__
    Qwen2VLImageTextProcessor.__qualname__ = PROCESSOR_CLASS
    return Qwen2VLImageTextProcessor


_PROCESSOR = None


def __getattr__(name: str):
    """The processor class (and ``ProcessorMixin``, which diffusers' loader looks up beside it)
    on first use: importing transformers' processors is slow."""
    global _PROCESSOR
    if name == PROCESSOR_CLASS:
        if _PROCESSOR is None:
            _PROCESSOR = processor_class()
        return _PROCESSOR
    if name == "ProcessorMixin":
        from transformers import ProcessorMixin

        return ProcessorMixin
    raise AttributeError(name)


class _AreaPipeline:
    """A ``QwenImageEditPlusPipeline`` whose sources' latents are encoded at the requested
    height x width area (the pipeline's ``VAE_IMAGE_SIZE``, 1024^2, for the call's duration),
    the size training encodes them at (the pipeline rounds each side to a multiple of 32, so a
    source of the target's shape keeps it when its sides are multiples of 32); everything else
    is the pipeline's."""

    def __init__(self, pipeline, resolution: int):
        self._pipeline, self._resolution = pipeline, resolution

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    def __call__(self, *args, **kwargs):
        kwargs["height"] = kwargs.get("height") or self._resolution
        kwargs["width"] = kwargs.get("width") or self._resolution
        with qwenimage_edit_plus_source_area(kwargs["height"] * kwargs["width"]):
            return self._pipeline(*args, **kwargs)


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit-Plus: Qwen-Image with the sources seen by Qwen2.5-VL and their packed
    latents beside the target's."""

    def load_tokenizer(self, folder):
        """The ``processor`` folder as ``Qwen2VLImageTextProcessor`` (its tokenizer tokenizes)."""
        return __getattr__(PROCESSOR_CLASS).from_pretrained(folder)

    def token_length(self, spec, tokenizer, max_sequence_length=None):
        return (
            DROPPED_TEMPLATE_TOKENS
            + MAX_SOURCES * PICTURE_TOKENS
            + self.sequence_length(spec, tokenizer, max_sequence_length)
        )

    def prompt_text(self, spec, caption, tokenizer=None):
        """The template with ``MAX_SOURCES`` picture blocks (``vision_inputs`` keeps a sample's
        K) before the instruction."""
        blocks = "".join(PICTURE_TEMPLATE.format(k + 1) for k in range(MAX_SOURCES))
        return PROMPT_TEMPLATE.format(blocks + caption)

    def tokenize(self, tokenizers, captions, max_sequence_length=None):
        """Template ids (``prompt_text``) by the processor's tokenizer, padded to
        ``token_length``; ``encode_texts`` fits them to the batch's sources."""
        return super().tokenize(
            {k: getattr(v, "tokenizer", v) for k, v in tokenizers.items()}, captions, max_sequence_length
        )

    def encode_texts(self, encoders, ids):
        """Qwen2.5-VL's outputs for the template ids and the batch's source images
        (``ids["source_pixel_values"]``, ``(N, K, 3, H, W)``): ``vision_inputs``, then the whole
        model called as the pipeline calls it. Collective when the encoder is sharded."""
        encoder = encoders.get("text_encoder")
        if encoder is None:
            return {}
        sources = ids.get("source_pixel_values")
        if sources is None:
            raise ValueError(
                "Qwen-Image-Edit's text encoder reads the source images: it needs the batch's "
                "source_pixel_values and cannot be cached"
            )
        inputs = vision_inputs(encoder.config, ids["input_ids"], ids["attention_mask"], sources)
        device = encoder.device
        return self.encode_text(
            "text_encoder",
            encoder,
            inputs["input_ids"].to(device),
            inputs["attention_mask"].to(device),
            pixel_values=None if inputs["pixel_values"] is None else inputs["pixel_values"].to(device),
            image_grid_thw=None if inputs["image_grid_thw"] is None else inputs["image_grid_thw"].to(device),
        )

    def encode_text(
        self, name, encoder, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None
    ):
        """The last hidden states after the 64 system-prompt tokens (image tokens included), zero
        where padded, with their mask. Collective when ``encoder`` is sharded."""
        out = encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        if attention_mask is None:  # every token valid (the planner sizes outputs so)
            attention_mask = torch.ones_like(input_ids)
        hidden = out.hidden_states[-1][:, DROPPED_TEMPLATE_TOKENS:]
        mask = attention_mask[:, DROPPED_TEMPLATE_TOKENS:].long()
        return {"prompt_embeds": hidden * mask[..., None].to(hidden.dtype), "prompt_embeds_mask": mask}

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """The transformer called as the pipeline's loop calls it: the target's packed noisy
        tokens, then each source's packed latents (``cond["source_latents"]``, ``(N, K, C, 1,
        h, w)``), ``img_shapes`` the target's then each source's; the target's tokens unpacked.
        Without sources it is Qwen-Image's call."""
        n, _, _, h, w = noisy_latents.shape
        tokens = [pack_latents(noisy_latents)]
        shapes = [(1, h // 2, w // 2)]
        source = cond.get("source_latents")
        if source is not None:
            for k in range(source.shape[1]):
                latents = source[:, k].to(noisy_latents.dtype)
                tokens.append(pack_latents(latents))
                shapes.append((1, latents.shape[-2] // 2, latents.shape[-1] // 2))
        target = tokens[0].shape[1]
        packed = denoiser(
            hidden_states=torch.cat(tokens, dim=1),
            timestep=(timesteps / 1000).to(noisy_latents.dtype),
            guidance=None,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[shapes] * n,
            return_dict=False,
        )[0]
        return unpack_latents(packed[:, :target], h, w)

    def pipeline(self, denoiser, vae, text_encoders, tokenizers, scheduler):
        """``QwenImageEditPlusPipeline`` with the processor and its tokenizer."""
        import diffusers

        processor = tokenizers["text_encoder"]
        return diffusers.QwenImageEditPlusPipeline(
            transformer=denoiser,
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=processor.tokenizer,
            processor=processor,
            scheduler=scheduler,
        )

    def prepare_validation_pipeline(self, pipeline, resolution):
        """The pipeline encoding its sources at the generated size (``_AreaPipeline``)."""
        return _AreaPipeline(pipeline, resolution)

    def published(self):
        (qwen_image,) = super().published()
        return self.published_as(
            qwen_image.components,  # Qwen-Image's shapes
            ("Qwen/Qwen-Image-Edit-2509", "Qwen-Image-Edit-2509"),
            note="text_encoder's vision tower runs: it reads the source images",
        )


QWENIMAGE_EDIT = QwenImageEdit(
    name="qwenimage-edit",
    title="Qwen-Image-Edit",
    pipeline_class="QwenImageEditPlusPipeline",
    text_encoders=(llm_text_encoder("Qwen2_5_VLForConditionalGeneration", "processor"),),
    denoiser_class="QwenImageTransformer2DModel",
    vae_class="AutoencoderKLQwenImage",
    sample_latents=QWENIMAGE.sample_latents,  # the target's latents sampled, as Qwen-Image's script
    edits=True,
    encodes_source_images=True,
    default_max_sequence_length=512,
    lora_target_modules=QWENIMAGE.lora_target_modules,
    # Qwen-Image's placements, then instructions on the demo's red circle (kontext.py)
    default_run_args=QWENIMAGE.default_run_args + EDIT_VALIDATION_ARGS,
)
