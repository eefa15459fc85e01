"""The VLM judges ``hpsv3`` and ``unifiedreward`` (``rewards.vlm_judges``) against their
authors' scoring transcribed here with plain transformers calls, on tiny models of the
published shapes, and each sharded on 2 real ranks against its replica.

The references (read from the authors' code; none of their packages is imported):

* HPSv3 (MizzenAI/HPSv3): ``HPSv3RewardInferencer.prepare_batch`` (``hpsv3/inference.py``: each
  image resized by qwen_vl_utils' ``fetch_image`` to 256 x 28 x 28 pixels, the chat of one user
  turn [image, ``INSTRUCTION.format(text_prompt=...) + prompt_with_special_token``] rendered with
  the generation prompt, the processor's batch right-padded) and ``Qwen2VLRewardModelBT.forward``
  with ``reward_token="special"`` (``hpsv3/model/qwen2vl_trainer.py``: the token embeddings with
  the vision tower's features scattered in, the decoder called on them without ``input_ids``,
  so with sequential positions, the fp32 ``rm_head`` on the last hidden state at
  ``<|Reward|>``); the score is ``logits[:, 0]`` (mu), as inference.py's example reads it.
* UnifiedReward (CodeGoat24/UnifiedReward,
  ``inference_qwen/image_generation/qwen_point_score_image_generation.py``): one image at a time,
  the processor's inputs of the chat [image, question], ``model.generate(**inputs,
  max_new_tokens=...)`` with the model's generation config, the new tokens decoded
  (``skip_special_tokens=True``), the first integer after the last ``Final Score:``
  (``DiffusionDPO/sift_dpo_data.py``), here divided by 5.

The tiny models keep the published head widths and rotary layout (Qwen2-VL-7B and
Qwen2.5-VL-7B: 128-wide text heads with mRoPE sections [16, 24, 24], 80-wide vision heads; the
published patching) and HPSv3's head widths (1024, 16, 2), at 2 layers of 2 heads.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from diffusers_zero3.rewards.vlm_judges import HPSV3_INSTRUCTION
from tests.common import rank_slice
from tests.distributed_harness import run_on_ranks
from tests.test_reward_registry import PROMPTS, _as_tensor, _pil, _uint8_images

QWEN_VL_CHAT = (  # Qwen2-VL's and Qwen2.5-VL's chat template rendered for [image, text], generation prompt
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN3_VL_CHAT = (  # Qwen3-VL's: no default system turn
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"
)
HPSV3_SIDE = 448  # 448 x 448 = 256 * 28 * 28: HPSv3's own size, nothing resized on either side
MAX_NEW_TOKENS = 8
# Measured here (the tests print them): HPSv3 fp32 max |ours - reference| 1.2e-7, bf16 (both sides
# in bf16, the head in fp32; ours left-padded, theirs right-padded) 2.7e-3, the scores 0.1 apart.
HPSV3_TOLERANCE = {torch.float32: dict(rtol=0, atol=1e-5), torch.bfloat16: dict(rtol=0, atol=1e-2)}


def _tokenizer(folder, *extra_special: str, texts: tuple[str, ...] = ()):
    from transformers import AutoTokenizer

    from diffusers_zero3.demo.tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen2_tokenizer

    words = ("system", "user", "assistant", "You are a helpful assistant.", *texts)
    write_qwen2_tokenizer(folder, (*QWEN_VL_SPECIAL_TOKENS, *extra_special), texts=words)
    return AutoTokenizer.from_pretrained(folder)


def _text_config(tok, published_text: dict) -> dict:
    """The published text config at 2 layers of 2 heads of its width (128), one KV head."""
    from diffusers_zero3.families.published import shrink

    tid = tok.convert_tokens_to_ids
    return shrink(
        published_text,
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ) | dict(
        rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default"},
        bos_token_id=tid("<|endoftext|>"),
        eos_token_id=tid("<|im_end|>"),
        pad_token_id=tid("<|endoftext|>"),
    )


# ------------------------------------------------------------------ HPSv3


HPSV3_TEXTS = (HPSV3_INSTRUCTION, "Please provide the overall ratings")  # its words one token each


def _legacy_names(state: dict) -> dict:
    """transformers 4's names of a Qwen2-VL (``model.*`` the decoder, ``visual.*``), the layout
    of the published HPSv3.safetensors; transformers 5 renames them as it loads."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.visual."):
            key = key.removeprefix("model.")
        out[key] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def hpsv3_folder(tmp_path_factory):
    """A tiny HPSv3: a Qwen2-VL of the published head widths with ``<|Reward|>`` in its
    vocabulary, HPSv3's head, saved as HPSv3 saves it (one safetensors file, transformers 4's
    names, ``rm_head.*`` beside the model's)."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.demo.pipelines import vl_token_ids
    from diffusers_zero3.families.published import QWEN2_VL_7B, shrink
    from diffusers_zero3.rewards.vlm_judges import hpsv3_head

    folder = tmp_path_factory.mktemp("hpsv3")
    tok = _tokenizer(folder, "<|Reward|>", texts=HPSV3_TEXTS)
    vision = shrink(QWEN2_VL_7B["vision_config"], depth=2, embed_dim=160, num_heads=2, hidden_size=256)
    config = Qwen2VLConfig(
        text_config=_text_config(tok, QWEN2_VL_7B["text_config"]),
        vision_config=vision,
        tie_word_embeddings=False,
        **vl_token_ids(tok.convert_tokens_to_ids),
    )
    torch.manual_seed(11)
    model = Qwen2VLForConditionalGeneration(config).eval()
    head = hpsv3_head((256, 1024, 16, 2))
    with torch.no_grad():  # weights at 1 / sqrt(fan_in): scores that differ between samples
        for layer in head:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0, layer.in_features**-0.5)
    model.save_pretrained(folder)
    state = _legacy_names(model.state_dict()) | {f"rm_head.{k}": v for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    return folder


def _hpsv3_reference(folder, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """HPSv3's scores as its inference computes them (module docstring), in ``dtype`` with the
    head in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    instruction = HPSV3_INSTRUCTION.replace("{prompt}", "{text_prompt}")
    special = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    state = {k.removeprefix("rm_head."): v for k, v in load_file(folder / "model.safetensors").items()}
    head = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
        torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2),
    )  # fmt: skip
    head.load_state_dict({k: v for k, v in state.items() if re.match(r"^\d\.", k)})
    head.float().eval()
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "right"  # create_model_and_processor: padding_side="right"
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    pil = _pil(images)
    assert all(im.size[0] * im.size[1] == 256 * 28 * 28 for im in pil)  # fetch_image: no resize
    vision = processor(images=pil, return_tensors="pt")
    merge = processor.merge_size**2
    texts = []
    for grid, prompt in zip(vision["image_grid_thw"], prompts):
        text = QWEN_VL_CHAT.format(text=instruction.format(text_prompt=prompt) + special)
        texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // merge)))
    batch = tok(texts, padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(ids)
        features = model.model.get_image_features(vision["pixel_values"].to(dtype), vision["image_grid_thw"])
        features = torch.cat(features.pooler_output).to(embeds.dtype)
        mask = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, features)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])[0]
        logits = head(hidden.float())  # torch.autocast(dtype=torch.float32) around the head
        special_mask = ids == tok.convert_tokens_to_ids("<|Reward|>")
        pooled = logits[special_mask, ...].view(len(ids), -1)
    return pooled[:, 0]


def _ours(name: str, folder, images: torch.Tensor, prompts, dtype, **kwargs) -> torch.Tensor:
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    specs = parse_reward_specs([name], [f"{name}={folder}"], [f"{name}=replicate"])
    rewards = load_rewards(specs, None, dtype, **kwargs)
    total, scores = rewards(images, prompts)
    torch.testing.assert_close(total, scores[name])
    return scores[name]


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hpsv3_is_the_authors_scoring(hpsv3_folder, dtype):
    images = _uint8_images(3, HPSV3_SIDE, HPSV3_SIDE, seed=4)
    prompts = PROMPTS[:3]  # of different lengths: ours left-padded, theirs right-padded
    ours = _ours("hpsv3", hpsv3_folder, _as_tensor(images), prompts, dtype, micro_batch_size=2)
    expected = _hpsv3_reference(hpsv3_folder, images, prompts, dtype)
    error = (ours - expected).abs().max().item()
    print(f"hpsv3 {dtype}: max |ours - reference| {error:.3g}, scores {expected.tolist()}")
    torch.testing.assert_close(ours, expected, **HPSV3_TOLERANCE[dtype])
    assert (
        ours.dtype == torch.float32 and expected.max() - expected.min() > 5 * HPSV3_TOLERANCE[dtype]["atol"]
    )


@pytest.mark.unit
def test_hpsv3_controls_positions_and_the_image_move_the_score(hpsv3_folder):
    """What the fp32 bound would catch: Qwen2-VL's multimodal positions instead of the
    reference's sequential ones, and the image (transposed) changing the score."""
    from diffusers_zero3.rewards.vlm_judges import HPSv3

    images = _as_tensor(_uint8_images(2, HPSV3_SIDE, HPSV3_SIDE, seed=5))
    judge = HPSv3.from_pretrained(hpsv3_folder)
    assert next(judge.head.parameters()).dtype == torch.float32 and "head" not in dict(judge.named_children())
    with torch.no_grad():
        rows = judge.preprocess(images, PROMPTS[:2])
        right = judge(rows)
        transposed = judge(judge.preprocess(images.transpose(-1, -2), PROMPTS[:2]))
        original = judge.model.model.forward
        judge.model.model.forward = lambda **kw: original(
            **{
                **kw,
                "position_ids": None,
                "mm_token_type_ids": (kw["input_ids"] == judge.image_token_id).long(),
            }
        )  # mRoPE positions
        try:
            mrope = judge(rows)
        finally:
            judge.model.model.forward = original
    print(f"mrope {(mrope - right).abs().max():.3g}, transposed {(transposed - right).abs().max():.3g}")
    assert (mrope - right).abs().max() > 1e-3
    assert (transposed - right).abs().max() > 1e-3


@pytest.mark.unit
def test_hpsv3_refuses_weights_without_its_head_or_a_tokenizer_without_its_token(hpsv3_folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from diffusers_zero3.rewards.vlm_judges import HPSv3

    folder = tmp_path / "no_head"
    shutil.copytree(hpsv3_folder, folder)
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("rm_head.")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"expected the head's tensors .* found none"):
        HPSv3.from_pretrained(folder)
    judge = HPSv3.from_pretrained(hpsv3_folder)
    plain = _tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"must hold <\|Reward\|> as one token"):
        HPSv3(judge.model, judge.head, plain, judge.image_config)


@pytest.mark.unit
def test_the_published_checkpoint_alone_is_refused_and_write_hpsv3_folder_makes_it_loadable(
    hpsv3_folder, tmp_path
):
    """The published weights are one file (``HPSv3.safetensors``): alone they are refused with
    the way out, and ``write_hpsv3_folder`` (the base Qwen2-VL's config, its tokenizer with
    ``<|Reward|>`` added, the vocabulary resized) gives the fixture's judge, score for score."""
    import json
    import shutil

    from transformers import AutoConfig

    from diffusers_zero3.rewards.vlm_judges import HPSv3, write_hpsv3_folder

    base = tmp_path / "qwen2-vl"  # the base as published: no <|Reward|>, a larger vocabulary
    tok = _tokenizer(base, texts=HPSV3_TEXTS)
    config = AutoConfig.from_pretrained(hpsv3_folder)
    config.text_config.vocab_size = len(tok) + 7
    config.save_pretrained(base)
    shutil.copy(hpsv3_folder / "preprocessor_config.json", base)
    published = tmp_path / "published"
    published.mkdir()
    shutil.copy(hpsv3_folder / "model.safetensors", published / "HPSv3.safetensors")
    with pytest.raises(ValueError, match="holds the published HPSv3.safetensors alone: write a folder"):
        HPSv3.from_pretrained(published)
    folder = write_hpsv3_folder(tmp_path / "hpsv3", published / "HPSv3.safetensors", base)
    assert json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"] == len(tok) + 1
    images = _as_tensor(_uint8_images(2, HPSV3_SIDE, HPSV3_SIDE, seed=7))
    with torch.no_grad():
        ours, fixture = HPSv3.from_pretrained(folder), HPSv3.from_pretrained(hpsv3_folder)
        torch.testing.assert_close(
            ours(ours.preprocess(images, PROMPTS[:2])),
            fixture(fixture.preprocess(images, PROMPTS[:2])),
            rtol=0,
            atol=0,
        )


# ------------------------------------------------------------------ UnifiedReward


def _score_chain(tok, digit_bias: dict[int, float] | None = None) -> list:
    """``sequence_bias`` entries that make a tiny judge answer ``Final Score: <digit>`` and stop,
    the digit its own choice: every pair of consecutive tokens of the answers (from the
    generation prompt's last token on) raised by 40, the pairs ending in a digit by 40 plus
    ``digit_bias[digit id]``."""
    newline = tok.encode("\n", add_special_tokens=False)
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    pairs = {}
    for digit in "12345":
        chain = newline + tok.encode(f"Final Score: {digit}", add_special_tokens=False) + end
        for pair in zip(chain, chain[1:]):
            pairs[pair] = 40.0 + (digit_bias or {}).get(pair[1], 0.0)
    return [[list(pair), bias] for pair, bias in sorted(pairs.items())]


def _digit_ids(tok) -> tuple[int, list[int]]:
    """``(step, ids)``: the answer step at which ``Final Score: <digit>`` answers differ, and the
    five digits' token ids there."""
    chains = [tok.encode(f"Final Score: {d}", add_special_tokens=False) for d in "12345"]
    step = next(i for i in range(len(chains[0])) if len({c[i] for c in chains}) > 1)
    return step, [c[step] for c in chains]


UNIFIED_SIDES = {"qwen2.5-vl": 56, "qwen3-vl": 64}  # multiples of the patch merge (28, 32): no resize


def _unified_images(family: str) -> np.ndarray:
    side = UNIFIED_SIDES[family]
    return _uint8_images(4, side, side, seed=6)


def _tiny_judge(family: str, tok):
    """A tiny Qwen2.5-VL or Qwen3-VL at the published head widths (text heads of 128 with the
    published mRoPE sections, vision heads of 80 / 72) and its image processor."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.demo.pipelines import vl_token_ids
    from diffusers_zero3.families.published import QWEN3_VL_8B, shrink
    from diffusers_zero3.families.qwenimage import PUBLISHED_TEXT_ENCODER as QWEN2_5_VL_7B

    ids = vl_token_ids(tok.convert_tokens_to_ids)
    if family == "qwen2.5-vl":
        vision = shrink(
            QWEN2_5_VL_7B["vision_config"], depth=2, hidden_size=160, intermediate_size=320, num_heads=2,
            out_hidden_size=256, fullatt_block_indexes=[1],
        )  # fmt: skip
        text = _text_config(tok, QWEN2_5_VL_7B["text_config"])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
        return Qwen2_5_VLForConditionalGeneration(config).eval(), Qwen2VLImageProcessorPil()
    vision = shrink(
        QWEN3_VL_8B["vision_config"], depth=2, hidden_size=144, intermediate_size=288, num_heads=2,
        out_hidden_size=256, deepstack_visual_indexes=[0],
    )  # fmt: skip
    text = _text_config(tok, QWEN3_VL_8B["text_config"]) | dict(
        rope_scaling=QWEN3_VL_8B["text_config"]["rope_scaling"]  # interleaved, sections [24, 20, 20]
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    processor = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLForConditionalGeneration(config).eval(), processor


def _build_unified(folder, family: str):
    """A tiny UnifiedReward judge of ``family`` in ``folder``: its generation config the published
    Qwen2.5-VL's (top-k 1 sampling, repetition penalty 1.05) with a ``sequence_bias`` that makes
    it answer ``Final Score: N`` (``_score_chain``)."""
    from transformers import GenerationConfig

    from diffusers_zero3.rewards.vlm_judges import UNIFIEDREWARD_QUESTION

    tok = _tokenizer(folder, texts=(UNIFIEDREWARD_QUESTION, "Final Score: 1 2 3 4 5"))
    torch.manual_seed(12)
    model, processor = _tiny_judge(family, tok)
    text = model.config.text_config
    with torch.no_grad():  # a judge with opinions: its logits spread, so the digit follows the input
        model.lm_head.weight.mul_(20.0)
    model.generation_config = GenerationConfig(
        do_sample=True, top_k=1, top_p=0.001, temperature=0.1, repetition_penalty=1.05,
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        sequence_bias=_score_chain(tok),
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    # The digits' raw logits differ between them by more than between inputs: each digit's
    # mean over the test's inputs is taken off its bias, so that each input's answer is the
    # digit its own logits favour most (calibrated on the test's images and prompts).
    step, digits = _digit_ids(tok)
    outputs = _reference_generations(
        folder, _unified_images(family), PROMPTS, torch.float32, output_logits=True
    )
    logits = torch.stack([out.logits[step][0, digits] for _, out in outputs])
    mean = logits.mean(0)
    model.generation_config.sequence_bias = _score_chain(tok, {d: -float(m) for d, m in zip(digits, mean)})
    model.generation_config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def unified_folders(tmp_path_factory):
    """``{family: folder}``: the tiny judges, built on first use."""
    folders = {}

    def get(family: str):
        if family not in folders:
            folders[family] = _build_unified(tmp_path_factory.mktemp(f"unifiedreward-{family}"), family)
        return folders[family]

    return get


def _reference_generations(folder, images: np.ndarray, prompts, dtype, **generate_kwargs):
    """Per sample: the authors' ``model.generate(**inputs, max_new_tokens=...)`` on the
    processor's inputs of the chat [image, question] (module docstring); ``(prompt length,
    output)``."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.rewards.vlm_judges import UNIFIEDREWARD_QUESTION

    config = AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0]).from_pretrained(folder, dtype=dtype).eval()
    chat = QWEN3_VL_CHAT if config.model_type == "qwen3_vl" else QWEN_VL_CHAT
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    for image, prompt in zip(_pil(images), prompts):
        vision = processor(images=[image], return_tensors="pt")
        n = int(vision["image_grid_thw"][0].prod()) // processor.merge_size**2
        text = chat.format(text=UNIFIEDREWARD_QUESTION.replace("{prompt}", prompt))
        inputs = tok([text.replace("<|image_pad|>", "<|image_pad|>" * n)], return_tensors="pt")
        mm = (inputs["input_ids"] == model.config.image_token_id).long()
        with torch.no_grad():
            out = model.generate(
                **inputs, pixel_values=vision["pixel_values"].to(dtype), image_grid_thw=vision["image_grid_thw"],
                mm_token_type_ids=mm, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, **generate_kwargs,
            )  # fmt: skip
        yield inputs["input_ids"].shape[1], out


def _unified_reference(folder, images: np.ndarray, prompts, dtype) -> tuple[torch.Tensor, list[str]]:
    """The authors' pointwise scoring (module docstring): the scores / 5 and the answers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    scores, answers = [], []
    for length, out in _reference_generations(folder, images, prompts, dtype):
        answer = tok.batch_decode(
            out.sequences[:, length:], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )[0]
        found = re.findall(r"\d+", answer.split("Final Score:")[-1].strip())
        scores.append(int(found[0]) / 5 if found else 0.0)
        answers.append(answer)
    return torch.tensor(scores), answers


def _unified_judge(folder, dtype=torch.float32):
    from diffusers_zero3.rewards.vlm_judges import UnifiedReward

    return UnifiedReward.from_pretrained(folder, dtype, max_new_tokens=MAX_NEW_TOKENS)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(UNIFIED_SIDES))
def test_unifiedreward_is_the_authors_generation_and_reading(unified_folders, family, dtype):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    unified_folder = unified_folders(family)
    images = _unified_images(family)
    prompts = PROMPTS  # of different lengths: ours a left-padded batch, theirs one at a time
    expected, answers = _unified_reference(unified_folder, images, prompts, dtype)
    judge = _unified_judge(unified_folder, dtype)
    with torch.no_grad():
        ours_answers = judge.answers(judge.preprocess(_as_tensor(images).to(dtype), prompts))
    print(f"unifiedreward {family} {dtype}: answers {ours_answers}, reference {answers}")
    assert ours_answers == answers
    specs = parse_reward_specs(
        ["unifiedreward"], [f"unifiedreward={unified_folder}"], ["unifiedreward=replicate"]
    )
    rewards = load_rewards(specs, None, dtype, micro_batch_size=3)
    rewards.rewards["unifiedreward"].model.module.max_new_tokens = MAX_NEW_TOKENS
    _, scores = rewards(_as_tensor(images), prompts)
    torch.testing.assert_close(scores["unifiedreward"], expected, rtol=0, atol=0)
    assert all("Final Score:" in a for a in answers) and len(set(expected.tolist())) > 1  # controls


@pytest.mark.unit
def test_parse_final_score_reads_as_the_authors():
    from diffusers_zero3.rewards.vlm_judges import parse_final_score

    cases = {
        "red (color): 1\nFinal Score: 4": 4,
        "Final Score: 2\n... Final Score: 5/5": 5,  # the last one
        "no score here": 0,
        "element: 1 Final Score:": 0,  # nothing after the last: 0, as sift_dpo_data.py
        "circle (shape): 1": 1,  # no 'Final Score:': the first integer of the whole answer
    }
    for answer, grade in cases.items():
        assert parse_final_score(answer) == grade, answer


# ------------------------------------------------------------------ 2 ranks


def worker_sharded_judges(hpsv3_folder: str, unified_folder: str, ref_path: str):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = accelerator.process_index
    ref = torch.load(ref_path)

    def whole(*args, **kwargs):
        raise AssertionError("a sharded judge was loaded whole")

    originals = {
        c: c.from_pretrained for c in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)
    }
    for cls in originals:
        cls.from_pretrained = whole
    try:  # default placement: shard, read straight into partitions
        specs = parse_reward_specs(
            ["hpsv3", "unifiedreward"], [f"hpsv3={hpsv3_folder}", f"unifiedreward={unified_folder}"]
        )
        judges = load_rewards(specs, accelerator, torch.float32, micro_batch_size=2)
    finally:
        for cls, original in originals.items():
            cls.from_pretrained = original
    judges.rewards["unifiedreward"].model.module.max_new_tokens = MAX_NEW_TOKENS
    for name in ("hpsv3", "unifiedreward"):
        assert judges.rewards[name].model.is_sharded, name
    # Uneven counts, zero included: one rank makes more micro-batches (and generation steps).
    for counts in ((3, 1), (0, 4)):
        for name, key in (("hpsv3", "hpsv3_images"), ("unifiedreward", "unified_images")):
            sl = rank_slice(counts, rank)
            only = type(judges)({name: judges.rewards[name]}, {name: 1.0})
            with only.lockstep_check():
                _, scores = only(ref[key][sl], ref["prompts"][sl])
            error = (scores[name] - ref[name][sl]).abs().max().item() if counts[rank] else 0.0
            print(f"rank {rank} {name} {counts}: {counts[rank]} scores, max |sharded - replica| {error:.3g}")
            torch.testing.assert_close(scores[name], ref[name][sl], rtol=0, atol=1e-5, msg=f"{name} {counts}")
    print("OK sharded judges")


@pytest.mark.multirank
def test_sharded_judges_equal_their_replicas_on_two_ranks_with_uneven_samples(
    hpsv3_folder, unified_folders, tmp_path
):
    unified_folder = unified_folders("qwen2.5-vl")
    hpsv3_images = _as_tensor(_uint8_images(4, HPSV3_SIDE, HPSV3_SIDE, seed=8))
    unified_images = _as_tensor(
        _uint8_images(4, UNIFIED_SIDES["qwen2.5-vl"], UNIFIED_SIDES["qwen2.5-vl"], seed=9)
    )
    ref = {
        "hpsv3_images": hpsv3_images,
        "unified_images": unified_images,
        "prompts": PROMPTS,
        "hpsv3": _ours("hpsv3", hpsv3_folder, hpsv3_images, PROMPTS, torch.float32),
    }
    judge = _unified_judge(unified_folder)
    with torch.no_grad():
        ref["unifiedreward"] = judge(judge.preprocess(unified_images, PROMPTS))
    torch.save(ref, tmp_path / "ref.pt")
    outs = run_on_ranks(
        worker_sharded_judges,
        timeout=240,
        hpsv3_folder=str(hpsv3_folder),
        unified_folder=str(unified_folder),
        ref_path=str(tmp_path / "ref.pt"),
    )
    print("".join(line for o in outs for line in o.splitlines(keepends=True) if "max |sharded" in line))
    assert all("OK sharded judges" in o for o in outs)
