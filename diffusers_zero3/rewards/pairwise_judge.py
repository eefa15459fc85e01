"""A pairwise VLM judge: Pref-GRPO's win-rate reward from a Qwen2-VL / Qwen2.5-VL's preference.

Pref-GRPO (arXiv 2508.20751, CodeGoat24/Pref-GRPO, ``fastvideo/rewards/unifiedreward_think.py``,
``cal_win_rate_images`` and ``_pairwise_win_rate``) rewards each image of a prompt's group by its
win rate over the other members: for every unordered pair of the group (``itertools.combinations``,
so each pair once, the lower index shown as Image 1) a UnifiedReward-Think judge served by vLLM
generates a reasoning and an ``<answer>``; the image it names ("Image 1 is better" / "Image 2 is
better") wins 1, and both get 0.5 when the answer names neither; an image's reward is its wins
divided by its comparisons (the group size minus one), rounded to 3 decimals. Its question is
``templates.get_unifiedreward_think_image_template`` (the caption, the dimensions semantic
consistency, aesthetics and authenticity, scores 1-10 each, then the answer).

``PairwiseVLMJudge`` keeps the win rate and reads the preference from one forward instead of a
generated text: the judge is shown Image 1, Image 2 and a question about the prompt ending in
"Answer 1 or 2", and ``P(first better) = P("1") / (P("1") + P("2"))`` from the next-token logits
(as ``builtin.VLMJudge`` reads P(Yes)). Two departures from the reference, both deliberate:

* the preference is a probability, so an image's win is soft (the reference's hard 1 / 0 / 0.5 is
  the same computation with the answer's probability rounded);
* each pair is judged in both orders and the two averaged (``groupwise.ordered_pairs``): a VLM
  judge favours a position, and in the reference's single order the lower-indexed image always
  sits first, which biases the win rates of a group by its members' order. The reference's own
  order is ``groupwise.ordered_pairs(..., both_orders=False)``.

No reasoning is generated (one forward per pair, differentiable in neither sense needed here):
a judge trained to think first (UnifiedReward-Think) answers here without its thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .builtin import VLMJudge
from .images import QwenVLImageConfig, check_images, check_prompts

# Qwen2-VL's and Qwen2.5-VL's chat template rendered for one user turn [image, image, text] with
# the generation prompt, as their processors' apply_chat_template gives it.
QWEN_VL_PAIR_CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
    "{question}<|im_end|>\n<|im_start|>assistant\n"
)
# Pref-GRPO's pairwise question (templates.get_unifiedreward_think_image_template: the caption in
# 「」, its three core dimensions, "Image 1 is better" / "Image 2 is better"), asked for a one-token
# answer instead of a reasoning.
PAIRWISE_QUESTION = (
    "You are an objective and precise evaluator for image quality comparison. You are given a text caption"
    " and two images generated based on this caption, Image 1 and Image 2. The caption for the generated"
    " images is: 「{prompt}」. Compare the two images on semantic consistency (how closely the image content"
    " aligns with the caption), aesthetics (composition, color usage, artistic expression) and authenticity"
    " (realism and attention to detail). Which image is better? Answer 1 or 2."
)
PAIRWISE_ANSWERS = ("1", "2")


class PairwiseVLMJudge(VLMJudge):
    """P(Image 1 is better) of a Qwen2-VL / Qwen2.5-VL shown two images and their prompt:
    ``P(a) / (P(a) + P(b))`` of the next token after ``question``, ``(a, b)`` = ``answers``.

    Its inputs are pairs ``[B, 2, 3, H, W]`` (``rewards.groupwise`` builds them from a group's
    members); its rows (``preprocess``) hold both images' patches after the chat's token ids, as
    ``VLMJudge``'s hold one. A group-wise reward (``reward_scope = "pairwise"``): each image's
    reward is its win rate in its group.

    Args:
        model: a ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``.
        tokenizer: its tokenizer.
        image_config: its image processor's steps.
        question: the question, ``{prompt}`` standing for the prompt.
        answers: the answers naming the first and the second image, one token each.
        template: the chat, ``{question}`` for the question and two ``<|image_pad|>``.
    """

    name = "pairwise_vlm"
    reward_scope = "pairwise"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        image_config: QwenVLImageConfig,
        question: str = PAIRWISE_QUESTION,
        answers: tuple[str, str] = PAIRWISE_ANSWERS,
        template: str = QWEN_VL_PAIR_CHAT,
    ):
        super().__init__(
            model, tokenizer, image_config, question=question, answers=answers, template=template
        )

    def preprocess(self, pairs: torch.Tensor, prompts: Sequence[str] | None) -> torch.Tensor:
        """Packed rows ``[B, D]`` of ``pairs`` (float ``[B, 2, 3, H, W]`` in ``[0, 1]``: the first
        and second image of each comparison) and their ``prompts``, on the pairs' device."""
        if not torch.is_tensor(pairs) or pairs.dim() != 5 or pairs.shape[1] != 2:
            shape = tuple(pairs.shape) if torch.is_tensor(pairs) else type(pairs).__name__
            raise ValueError(f"reward '{self.name}' takes pairs of images [B, 2, 3, H, W], got {shape}")
        flat = pairs.flatten(0, 1)
        check_images(flat, self.name)
        prompts = check_prompts(self.name, pairs, prompts, "pair")
        if not len(pairs):
            return torch.zeros(0, 1, device=pairs.device)
        return self.pack_chats(flat, prompts)  # two images a chat

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """P(first better) ``[B]`` in ``[0, 1]`` (float32) of packed rows (``preprocess``)."""
        return self.first_answer_probability(rows)
