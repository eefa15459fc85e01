"""What several families' definitions write alike beyond ``base.Family``: their default run's
flags (``run_args``), their one LLM prompt encoder (``llm_text_encoder``), validation at the
pipeline's own guidance (``SequenceLengthValidation``) or at ``--guidance_scale``
(``GuidedValidation``), and Qwen3's chat prompt
(``qwen3_chat_prompt``: Z-Image, Flux.2 [klein])."""

from __future__ import annotations

from .base import TextEncoderSpec


def run_args(*, max_sequence_length: int | None = None, num_frames: int | None = None, **placements: str):
    """A family's ``default_run_args`` (``make train MODEL=<name>``): ``--<component>_placement
    <placement>`` for each keyword, in the order given, then ``--max_sequence_length`` and
    ``--num_frames`` where given: ``run_args(text_encoder="shard", vae="replicate",
    max_sequence_length=32)``."""
    args = [arg for component, how in placements.items() for arg in (f"--{component}_placement", how)]
    if max_sequence_length is not None:
        args += ["--max_sequence_length", str(max_sequence_length)]
    if num_frames is not None:
        args += ["--num_frames", str(num_frames)]
    return tuple(args)


def llm_text_encoder(model_class: str, tokenizer: str = "tokenizer") -> TextEncoderSpec:
    """The ``text_encoder`` of a family prompted through one LLM or VLM (Qwen-Image, Z-Image,
    Flux.2, Krea 2, ...): ``model_class`` read through the ``tokenizer`` folder (``"processor"``
    where the pipeline holds a VLM's processor), its ids under ``input_ids``, prompts of
    ``--max_sequence_length`` tokens."""
    return TextEncoderSpec("text_encoder", model_class, tokenizer, "input_ids", uses_max_sequence_length=True)


class SequenceLengthValidation:
    """A mixin of a ``Family`` whose validation images are sampled at its pipeline's own guidance
    (its CFG default), as its training script validates: the pipeline call is given the
    training's ``max_sequence_length`` only (``--guidance_scale`` sets the embedded guidance of
    Flux's distilled models, not these pipelines' CFG)."""

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        return {"max_sequence_length": max_sequence_length or self.default_max_sequence_length}


class GuidedValidation(SequenceLengthValidation):
    """A mixin of a ``Family`` whose validation images are sampled with the training's
    ``max_sequence_length`` and, when given, ``--guidance_scale`` (Flux.1's and Flux.2 [dev]'s
    embedded guidance, as in training; HiDream's CFG); the pipeline's default guidance
    otherwise."""

    def validation_kwargs(self, max_sequence_length, guidance_scale):
        kwargs = super().validation_kwargs(max_sequence_length, guidance_scale)
        if guidance_scale is not None:
            kwargs["guidance_scale"] = guidance_scale
        return kwargs


# What Qwen3's chat template renders for one user turn and the generation prompt (where no
# tokenizer is at hand): with thinking enabled (its default), and disabled (an empty think block).
QWEN3_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QWEN3_PROMPT_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"


def qwen3_chat_prompt(caption: str, tokenizer, enable_thinking: bool) -> str:
    """``caption`` as one user turn and the generation prompt in ``tokenizer``'s chat template
    with ``enable_thinking`` (as ``ZImagePipeline`` and ``Flux2KleinPipeline`` render it);
    without a tokenizer, what Qwen3's template renders."""
    if tokenizer is None:
        return (QWEN3_PROMPT if enable_thinking else QWEN3_PROMPT_NO_THINKING).format(caption)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": caption}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
