"""The ``imagereward`` built-in (``rewards.imagereward``) against the authors' own model and
``ImageReward.score`` (the image-reward 1.5 wheel): a tiny ``ImageReward`` module built by their
code, saved as the published ``ImageReward.pt`` and ``med_config.json``, scored by their
``score`` and by us through ``load_rewards``.

How the authors' code is run here, and what is not theirs:

* timm and the authors' modules import torchvision, which cannot run on this machine: they are
  imported inside ``reference_imports.torchvision_stub()``, the ``ImageReward`` and
  ``ImageReward.models`` packages as empty stand-ins (their ``__init__`` imports ReFL and
  CLIP extras), the model files (``ImageReward.py``, ``models/BLIP/{blip,blip_pretrain,med,
  vit}.py``) as they are. fairscale is the real package.
* ``ImageReward.__init__`` builds ``BLIP_Pretrain(vit='large')``, whose ``create_vit`` has the
  ViT-L sizes written in: ``blip_pretrain.create_vit`` is replaced by ``tiny_create_vit``,
  which builds vit.py's ``VisionTransformer`` through its constructor as ``create_vit``
  does, at width 128 (BLIP's 64-wide heads, as ours assumes), depth 2, patch 16, image 224.
  The text encoder keeps the published width (768, which ``MLP(768)`` is written for) with 2
  layers and a 64-wide feed-forward (``TINY_MED_CONFIG``). The head's weights are drawn
  again at ``1 / sqrt(fan_in)``: with the authors' ``1 / (input_size + 1)`` a random head
  gives ``-mean / std`` for every sample.
* ``ImageReward._transform`` (torchvision's Resize, CenterCrop, ToTensor, Normalize) is
  replaced by ``pil_transform``, the same steps with PIL and torch (Resize of the short side
  with Pillow's bicubic, skipped at that size already; torchvision's crop offsets).
* ``init_tokenizer`` loads ``bert-base-uncased``: it is built with the working directory at a
  folder holding ``bert-base-uncased/vocab.txt`` (a small WordPiece vocabulary written here).
* med.py and init_tokenizer were written for transformers 4; transformers 5 moved or dropped
  what they use (``transformers4_shims``): ``apply_chunking_to_forward`` and
  ``prune_linear_layer`` are taken from ``transformers.pytorch_utils`` into
  ``modeling_utils`` for the import; ``find_pruneable_heads_and_indices`` (only for
  ``prune_heads``, never called) is a function that raises; med's ``BertPreTrainedModel``
  gets transformers 4's ``get_head_mask`` and ``invert_attention_mask`` (copied) and an
  empty ``all_tied_weights_keys``; ``BertTokenizer.additional_special_tokens_ids`` is
  transformers 4's property, for the construction only (its value, ``enc_token_id``, is not
  used by the score).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.reference_imports import torchvision_stub
from tests.test_reward_registry import PROMPTS, _as_tensor, _pil, _smooth_images, _uint8_images

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # ImageReward.py _transform's Normalize
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(
    {w for p in PROMPTS for w in p.split()} | {"many", "shapes", "and", "##s", "photos", "!", ","}
)
TINY_MED_CONFIG = {  # the published med_config.json, narrow and shallow where it can be
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 40,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": len(VOCAB) + 2,  # BLIP's [DEC] and [ENC]
    "encoder_width": 768,
    "add_cross_attention": True,
}
TOKENIZER_PROMPTS = [
    *PROMPTS,
    "A Photo of the RED circle , and shapes !",  # upper case: lower-cased; "shapes" one piece
    " ".join(["many red circles and blue squares"] * 8),  # past 35 tokens: truncated
    "an unknown word [ENC] and [DEC]",  # [UNK]s, and BLIP's added tokens kept whole
]
# A bf16 run scores ImageReward in fp32 (issue 50, as the RL references score): the authors'
# fp32 scores within fp32 bounds whatever the run's dtype.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def pil_transform(n_px: int):
    """ImageReward.py's ``_transform(n_px)`` with PIL and torch: ``Resize(n_px, BICUBIC)``
    (torchvision: the short side to ``n_px``, the long one ``int(n_px * long / short)``, no
    resize when that is the size already, PIL's ``resize`` otherwise), ``CenterCrop(n_px)``
    (``int(round((size - n_px) / 2.0))``), RGB, ``ToTensor`` (``/ 255``), ``Normalize``."""
    from PIL import Image

    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)

    def transform(image):
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = n_px, int(n_px * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        if (new_h, new_w) != (h, w):
            image = image.resize((new_w, new_h), Image.BICUBIC)
        top, left = int(round((new_h - n_px) / 2.0)), int(round((new_w - n_px) / 2.0))
        image = image.crop((left, top, left + n_px, top + n_px)).convert("RGB")
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float() / 255
        return (pixels - mean) / std

    return transform


# ------------------------------------------------------------------ transformers 4 names


def _find_pruneable_heads_and_indices(*args, **kwargs):
    raise NotImplementedError("prune_heads is not used by ImageReward's score")


def _get_head_mask(self, head_mask, num_hidden_layers, is_attention_chunked=False):
    """transformers 4's ``ModuleUtilsMixin.get_head_mask`` where no head mask is given (the
    only case ImageReward's score makes)."""
    if head_mask is not None:
        raise NotImplementedError("head masks are not used by ImageReward's score")
    return [None] * num_hidden_layers


def _invert_attention_mask(self, encoder_attention_mask):
    """transformers 4's ``ModuleUtilsMixin.invert_attention_mask``."""
    if encoder_attention_mask.dim() == 3:
        extended = encoder_attention_mask[:, None, :, :]
    if encoder_attention_mask.dim() == 2:
        extended = encoder_attention_mask[:, None, None, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


@contextlib.contextmanager
def transformers4_shims():
    """The names med.py imports from ``transformers.modeling_utils``, and
    ``BertTokenizer.additional_special_tokens_ids``, for as long as the context lasts."""
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils
    from transformers import BertTokenizer

    added = {
        "apply_chunking_to_forward": pytorch_utils.apply_chunking_to_forward,
        "prune_linear_layer": pytorch_utils.prune_linear_layer,
        "find_pruneable_heads_and_indices": _find_pruneable_heads_and_indices,
    }
    added = {k: v for k, v in added.items() if not hasattr(modeling_utils, k)}
    for name, value in added.items():
        setattr(modeling_utils, name, value)
    had_property = "additional_special_tokens_ids" in vars(BertTokenizer)
    if not had_property:
        BertTokenizer.additional_special_tokens_ids = property(
            lambda self: self.convert_tokens_to_ids([str(t) for t in self._extra_special_tokens])
        )
    try:
        yield
    finally:
        for name in added:
            delattr(modeling_utils, name)
        if not had_property:
            del BertTokenizer.additional_special_tokens_ids


def _import_authors_modules() -> types.SimpleNamespace:
    """``ImageReward.py`` and ``models/BLIP/{blip_pretrain,vit,med}.py`` of the installed
    wheel, their packages' ``__init__`` left out. Inside ``torchvision_stub()``."""
    for package in ("ImageReward", "timm", "fairscale"):
        if importlib.util.find_spec(package) is None:  # `make reference-packages` installs them
            raise ImportError(f"the reference needs {package}: make reference-packages")
    spec = importlib.util.find_spec("ImageReward")
    root = Path(list(spec.submodule_search_locations)[0])
    for name, folder in (("ImageReward", root), ("ImageReward.models", root / "models")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return types.SimpleNamespace(
        image_reward=importlib.import_module("ImageReward.ImageReward"),
        blip_pretrain=importlib.import_module("ImageReward.models.BLIP.blip_pretrain"),
        vit=importlib.import_module("ImageReward.models.BLIP.vit"),
        med=importlib.import_module("ImageReward.models.BLIP.med"),
    )


def _tiny_authors_model(folder: Path) -> torch.nn.Module:
    """The authors' ``ImageReward(med_config)`` at tiny sizes (see the module docstring), on
    the CPU, in eval mode, its preprocess ``pil_transform(224)``."""
    with torchvision_stub(), transformers4_shims():
        authors = _import_authors_modules()
        med = authors.med.BertPreTrainedModel
        med.get_head_mask, med.invert_attention_mask = _get_head_mask, _invert_attention_mask
        med.all_tied_weights_keys = {}

        def tiny_create_vit(vit, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
            width = 128
            encoder = authors.vit.VisionTransformer(
                img_size=image_size, patch_size=16, embed_dim=width, depth=2, num_heads=width // 64,
                use_grad_checkpointing=use_grad_checkpointing, ckpt_layer=ckpt_layer,
                drop_path_rate=0.1 or drop_path_rate,
            )  # fmt: skip
            return encoder, width

        authors.blip_pretrain.create_vit = tiny_create_vit
        authors.image_reward._transform = pil_transform
        cwd = os.getcwd()
        os.chdir(folder)  # init_tokenizer: BertTokenizer.from_pretrained('bert-base-uncased')
        try:
            torch.manual_seed(0)
            model = authors.image_reward.ImageReward(med_config=str(folder / "med_config.json"), device="cpu")
        finally:
            os.chdir(cwd)
    with torch.no_grad():
        for name, p in model.mlp.layers.named_parameters():
            torch.nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]) if "weight" in name else 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def imagereward(tmp_path_factory):
    """``(folder, authors' model)``: the folder holds what ``from_pretrained`` reads (the
    authors' state dict as ``ImageReward.pt``, ``med_config.json``, the vocabulary)."""
    build = tmp_path_factory.mktemp("imagereward-build")
    (build / "bert-base-uncased").mkdir()
    (build / "bert-base-uncased" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (build / "med_config.json").write_text(json.dumps(TINY_MED_CONFIG))
    model = _tiny_authors_model(build)
    folder = tmp_path_factory.mktemp("imagereward")
    torch.save(model.state_dict(), folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(TINY_MED_CONFIG))
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder, model


def _reference_scores(model, images: np.ndarray, prompts, dtype) -> torch.Tensor:
    """``ImageReward.score(prompt, pil_image)`` per sample. In bf16 the BLIP runs in bf16 (the
    pixels cast to it, as ours are) and the MLP stays float32, as ``score`` casts the
    feature to float32 before it."""
    model = copy.deepcopy(model)
    model.blip.to(dtype)
    transform = model.preprocess
    model.preprocess = lambda image: transform(image).to(dtype)
    with torch.no_grad():
        return torch.tensor([model.score(p, im) for p, im in zip(prompts, _pil(images))])


def _ours(folder, images: torch.Tensor, prompts, dtype, **kwargs) -> torch.Tensor:
    """Our scores through the spec, ``load_rewards`` (replicated) and ``ParallelReward``."""
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    specs = parse_reward_specs(["imagereward"], [f"imagereward={folder}"], ["imagereward=replicate"])
    rewards = load_rewards(specs, None, dtype, **kwargs)
    assert rewards.rewards["imagereward"].model.placement == "replicate"
    total, scores = rewards(images, prompts)
    torch.testing.assert_close(total, scores["imagereward"])
    return scores["imagereward"]


# ------------------------------------------------------------------ the tests


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_imagereward_is_the_authors_score(imagereward, dtype):
    folder, model = imagereward
    # 224 x 251: the short side is the model's size (nothing resized), the crop's left offset
    # round(13.5) = 14 (torchvision), not 27 // 2 = 13 (transformers' processors)
    images = _uint8_images(5, 224, 251, seed=11)
    prompts = [*PROMPTS, PROMPTS[0]]
    ours = _ours(folder, _as_tensor(images), prompts, dtype, micro_batch_size=2)
    expected = _reference_scores(model, images, prompts, torch.float32)
    print(f"imagereward {dtype}: max |ours - reference| = {(ours - expected).abs().max().item():.3g}")
    torch.testing.assert_close(ours, expected, **TOLERANCE)
    # Controls: the scores spread far wider than the bounds, and the image moves them (the same
    # prompt on two images; the images shifted by one pixel, as a wrong crop offset would).
    assert ours.max() - ours.min() > 0.2, ours
    assert (ours[0] - ours[4]).abs() > 1e-3, ours
    if dtype == torch.float32:
        shifted = _ours(folder, _as_tensor(images).roll(1, dims=-1), prompts, dtype)
        assert (shifted - ours).abs().max() > 1e-4


@pytest.mark.unit
def test_imagereward_token_ids_are_blips_tokenizer(imagereward):
    from diffusers_zero3.rewards.imagereward import ImageRewardModel
    from diffusers_zero3.rewards.images import unpack_rows

    folder, model = imagereward
    ours = ImageRewardModel.from_pretrained(folder)
    n = len(TOKENIZER_PROMPTS)
    ints, _ = unpack_rows(ours.preprocess(_as_tensor(_uint8_images(n, 224, 224)), TOKENIZER_PROMPTS))
    expected = model.blip.tokenizer(
        TOKENIZER_PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    assert torch.equal(ints[:, :35], expected.input_ids)
    assert torch.equal(ints[:, 35:], expected.attention_mask)
    assert expected.attention_mask[-2].all() and not expected.attention_mask[0].all()  # truncated, padded
    unknown = model.blip.tokenizer.unk_token_id
    assert {unknown, len(VOCAB), len(VOCAB) + 1} <= set(expected.input_ids[-1].tolist())  # [DEC], [ENC]
    for name in ("ImageReward", "timm", "fairscale", "torchvision"):
        assert name not in sys.modules, f"ours imported {name}"


@pytest.mark.unit
def test_imagereward_pixels_are_the_published_transform():
    """Our tensor preprocessing against ``pil_transform``: exact where nothing is resized
    (torchvision's crop offsets on both sides), within 1.5 8-bit levels where Pillow's
    bicubic resizes (shrinking and enlarging, either side longer)."""
    from diffusers_zero3.rewards.imagereward import blip_pixel_values

    level = 1.5 / 255 / min(CLIP_STD)
    transform = pil_transform(32)
    for size in ((32, 47), (45, 32), (32, 32), (40, 52), (52, 41), (24, 30)):
        images = _smooth_images(2, *size, seed=3)
        expected = torch.stack([transform(im) for im in _pil(images)])
        ours = blip_pixel_values(_as_tensor(images), 32)
        atol = 1e-6 if min(size) == 32 else level
        torch.testing.assert_close(ours, expected, rtol=0, atol=atol, msg=str(size))
    with pytest.raises(AssertionError):  # a control: transformers' offset, (47 - 32) // 2 = 7, is not 8
        images = _smooth_images(1, 32, 47, seed=3)
        x = _as_tensor(images)[..., 7:39]
        torch.testing.assert_close(
            (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1),
            transform(_pil(images)[0])[None],
            rtol=0,
            atol=1e-6,
        )


@pytest.mark.unit
def test_an_imagereward_folder_without_its_files_is_a_clear_error(imagereward, tmp_path):
    from diffusers_zero3.rewards.imagereward import ImageRewardModel

    with pytest.raises(ValueError, match="has no ImageReward.pt and no med_config.json"):
        ImageRewardModel.from_pretrained(tmp_path)
    (tmp_path / "ImageReward.pt").write_bytes((imagereward[0] / "ImageReward.pt").read_bytes())
    with pytest.raises(ValueError, match=r"has no med_config.json \(it needs"):
        ImageRewardModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        ImageRewardModel.from_pretrained(tmp_path / "ImageReward.pt")
    # weights of another size than the config: named as the weights not fitting
    (tmp_path / "med_config.json").write_text(json.dumps({**TINY_MED_CONFIG, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"the text encoder \(blip.text_encoder\) weights do not fit"):
        ImageRewardModel.from_pretrained(tmp_path)
