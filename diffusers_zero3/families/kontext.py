"""Flux.1 Kontext (``FluxKontextPipeline``): instruction editing, source image(s) + instruction ->
target image. Flux.1's encoders, VAE, packing and distilled guidance (``flux.py``); the source
image's latents (the VAE's mode, normalised as the target's) are 2x2-packed and appended to the
target's noisy tokens, their position ids marked with a first coordinate of 1 (the target's
are 0), and the prediction is read off the target's tokens alone, as the pipeline's loop and
diffusers' ``train_dreambooth_lora_flux_kontext.py`` do.

Several source images of one sample (``cond["source_latents"]`` of shape ``(N, K, C, h, w)``)
sit side by side in that first-coordinate-1 plane: source ``k``'s column ids start where source
``k - 1``'s end. That is what the pipeline sees when it is given the K sources stitched left to
right into one image (the transformer has no position information beyond its rotary ids), so
a model trained on K sources is used with their stitched image.
"""

from __future__ import annotations

import torch

from ..runtime.library_internals import kontext_keep_source_size
from .flux import (
    FLUX,
    FLUX_LORA_TARGETS,
    Flux,
    guidance_values,
    latent_image_ids,
    pack_latents,
    unpack_latents,
)

# The validation of an editing family's default run (`make train MODEL=kontext`): instructions of
# the demo's editing pairs (demo/edits.py) on the red circle demo.save_tiny_pipeline writes beside
# the tiny pipeline. They must come after train_default.sh's generic text-to-image prompts.
EDIT_VALIDATION_ARGS = (
    "--validation_image",
    "{pipeline}-source.png",
    "--validation_prompts",
    "make the circle blue",
    "make the circle green",
    "make the circle yellow",
)
SOURCE_ID = 1.0  # the first position id coordinate of source tokens (the pipeline's image_ids[..., 0] = 1)
DEFAULT_GUIDANCE = 3.5  # the Kontext script's --guidance_scale and the pipeline's default


def source_tokens(
    source_latents: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, ids)`` of source latents ``(N, C, h, w)`` or ``(N, K, C, h, w)``: each source
    2x2-packed, the K sources' tokens one after another, and their position ids ``(1, row,
    column)``, source ``k``'s columns offset by the packed widths of the sources before it."""
    if source_latents.ndim == 4:
        source_latents = source_latents.unsqueeze(1)
    tokens, ids, offset = [], [], 0
    for k in range(source_latents.shape[1]):
        latents = source_latents[:, k]
        h, w = latents.shape[-2:]
        tokens.append(pack_latents(latents))
        kid = latent_image_ids(h, w, latents.device, dtype or latents.dtype)
        kid[:, 0] = SOURCE_ID
        kid[:, 2] += offset
        ids.append(kid)
        offset += w // 2
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0)


class _AreaPipeline:
    """A ``FluxKontextPipeline`` whose calls keep the requested size: the pipeline rescales
    every request to ``max_area`` (default 1024^2) and, with ``_auto_resize``, a source image to
    its preferred Kontext resolutions; here ``max_area`` is the requested height x width and a
    source keeps its own size (floored to the pipeline's multiple, as the pipeline does without
    ``_auto_resize``). Everything else is the pipeline's."""

    def __init__(self, pipeline, resolution: int):
        self._pipeline, self._resolution = pipeline, resolution

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    def __call__(self, *args, **kwargs):
        height = kwargs.get("height") or self._resolution
        width = kwargs.get("width") or self._resolution
        kwargs.setdefault("max_area", height * width)
        for key, value in kontext_keep_source_size().items():
            kwargs.setdefault(key, value)
        return self._pipeline(*args, **kwargs)


class Kontext(Flux):
    """Flux.1 Kontext: Flux.1 with the source image's packed latents beside the target's."""

    def predict(self, denoiser, noisy_latents, timesteps, cond, *, guidance_scale=None):
        """The transformer called as ``FluxKontextPipeline``'s loop calls it: the target's noisy
        tokens (ids ``(0, row, column)``) then the source tokens (``source_tokens``), the
        prediction of the target's tokens unpacked. Without ``cond["source_latents"]`` it is
        Flux.1's text-to-image call (the pipeline without an image)."""
        n, _, h, w = noisy_latents.shape
        states = cond["encoder_hidden_states"]
        tokens = pack_latents(noisy_latents)
        ids = latent_image_ids(h, w, noisy_latents.device, noisy_latents.dtype)
        target_tokens = tokens.shape[1]
        source = cond.get("source_latents")
        if source is not None:
            src_tokens, src_ids = source_tokens(source.to(noisy_latents.dtype), noisy_latents.dtype)
            tokens = torch.cat([tokens, src_tokens], dim=1)
            ids = torch.cat([ids, src_ids], dim=0)
        scale = DEFAULT_GUIDANCE if guidance_scale is None else guidance_scale
        packed = denoiser(
            hidden_states=tokens,
            timestep=timesteps / 1000,
            guidance=guidance_values(denoiser, n, scale, noisy_latents.device),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=states,
            txt_ids=torch.zeros(states.shape[1], 3, device=states.device, dtype=states.dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack_latents(packed[:, :target_tokens], h, w)

    def size_kwargs(self, height, width):
        """``height`` x ``width`` and the same ``max_area`` (the pipeline rescales every request
        to ``max_area``, default 1024^2), the source at its own size (``_auto_resize=False``: not
        resized to a preferred Kontext resolution), as ``_AreaPipeline`` calls it."""
        return {"height": height, "width": width, "max_area": height * width, **kontext_keep_source_size()}

    def prepare_validation_pipeline(self, pipeline, resolution):
        """The pipeline generating (and editing at) ``resolution`` x ``resolution`` or the
        requested size, not its default 1024^2 area (``_AreaPipeline``)."""
        return _AreaPipeline(pipeline, resolution)

    def published(self):
        (dev,) = super().published()
        return self.published_as(
            dev.components,  # Flux.1 [dev]'s shapes
            ("black-forest-labs/FLUX.1-Kontext-dev", "FLUX.1 Kontext [dev]"),
            note="Flux.1 [dev]'s shapes; each source image adds its tokens to the transformer's sequence "
            "(a 1024 px source doubles it), and the VAE is not cached for editing pairs",
        )


KONTEXT = Kontext(
    name="kontext",
    title="Flux.1 Kontext",
    default_run_args=FLUX.default_run_args + EDIT_VALIDATION_ARGS,  # Flux.1's placements
    pipeline_class="FluxKontextPipeline",
    text_encoders=FLUX.text_encoders,  # CLIP-L (pooled) and T5
    denoiser_class="FluxTransformer2DModel",
    sample_latents=False,  # the script's --vae_encode_mode mode (and the pipeline's argmax of the source)
    edits=True,
    default_max_sequence_length=512,  # train_dreambooth_lora_flux_kontext.py
    lora_target_modules=(*FLUX_LORA_TARGETS, "proj_mlp"),  # the Kontext script's targets
)
