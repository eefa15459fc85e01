"""Each recipe's settings are one typed object: a dataclass whose fields are the flags, turned
into the parser (``diffusers_zero3.args.settings_parser``), read by attribute in the library."""

from __future__ import annotations

import ast
import dataclasses
import types
import typing

import pytest

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit


def _recipes() -> dict[str, type]:
    from diffusers_zero3.recipes.controlnet import ControlNetSettings
    from diffusers_zero3.recipes.dpo import DPOSettings
    from diffusers_zero3.recipes.dreambooth import DreamBoothSettings
    from diffusers_zero3.recipes.grpo import GRPOSettings
    from diffusers_zero3.recipes.reward import RewardSettings
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    return {
        "train_text_to_image.py": TextToImageSettings,
        "train_dreambooth.py": DreamBoothSettings,
        "train_controlnet.py": ControlNetSettings,
        "train_dpo.py": DPOSettings,
        "train_reward.py": RewardSettings,
        "train_grpo.py": GRPOSettings,
    }


def test_each_recipes_parser_has_exactly_its_settings_fields_with_their_types():
    """Every field is a flag and every flag a field; a value given on the command line comes
    back as the field's type (so the library can trust the annotations)."""
    from diffusers_zero3.args import parse_bool, settings_parser

    for script, settings in _recipes().items():
        parser = settings_parser(settings)
        dests = {a.dest for a in parser._actions if a.dest != "help"}
        fields = {f.name for f in dataclasses.fields(settings)}
        assert dests == fields, (script, dests ^ fields)
        hints = typing.get_type_hints(settings)
        for action in parser._actions:
            if action.dest == "help":
                continue
            hint = hints[action.dest]
            union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
            if kinds[0] is bool and action.type is parse_bool:  # upstream's type=bool flags
                assert isinstance(action.default, bool), (script, action.dest)
            elif kinds[0] is bool:
                assert action.nargs == 0 and action.default is False, (script, action.dest)
            elif typing.get_origin(kinds[0]) is list:
                assert action.type is typing.get_args(kinds[0])[0], (script, action.dest)
            else:
                assert action.type is kinds[0], (script, action.dest)
                if action.default is not None:  # the default is of the field's type (int for a float is fine)
                    assert isinstance(action.default, (kinds[0], int)), (script, action.dest, action.default)


def test_parse_returns_the_typed_object_with_the_recipes_own_defaults():
    """``Settings.parse`` returns an instance of the recipe's class; a recipe's ``redefault`` of
    a shared flag changes the default and keeps the help and choices."""
    recipes = _recipes()
    t2i = recipes["train_text_to_image.py"].parse(
        ["--pretrained_model_name_or_path", "p", "--train_data_dir", "d"]
    )
    assert type(t2i).__name__ == "TextToImageSettings" and t2i.learning_rate == 1e-4
    dreambooth = recipes["train_dreambooth.py"].parse(
        ["--pretrained_model_name_or_path", "p", "--instance_data_dir", "i", "--instance_prompt", "sks"]
    )
    assert type(dreambooth).__name__ == "DreamBoothSettings"
    assert (dreambooth.learning_rate, dreambooth.train_batch_size, dreambooth.output_dir) == (
        5e-6,
        4,
        "dreambooth-model",
    )
    assert dreambooth.train_data_dir == "i"  # resolved from --instance_data_dir
    base = dataclasses.fields(recipes["train_text_to_image.py"])
    mine = {f.name: f for f in dataclasses.fields(recipes["train_dreambooth.py"])}
    for field in base:
        assert mine[field.name].metadata == field.metadata, field.name
    reward = recipes["train_reward.py"].parse(
        ["--pretrained_model_name_or_path", "p", "--reward_model_name_or_path", "r", "--prompts", "a", "b"]
    )
    assert (reward.prompts, reward.reward_placement, reward.gradient_accumulation_steps) == (
        ["a", "b"],
        [],
        1,
    )
    from diffusers_zero3.recipes.reward import reward_specs

    (spec,) = reward_specs(reward)  # the old flags are one model-class reward of the registry, sharded
    assert (spec.name, spec.model_path, spec.placement) == (
        "diffusers_zero3.demo:RednessRewardModel",
        "r",
        "shard",
    )
    assert spec.model_class.__name__ == "RednessRewardModel"


def test_flag_kinds_parse_as_argparse_would():
    """A small settings class: store_true, nargs "+", a repeatable flag, choices, required, and a
    boolean that defaults to True refused when the parser is built (it could never be turned off)."""
    from diffusers_zero3.args import Settings, flag, settings_parser

    @dataclasses.dataclass
    class Mine(Settings):
        model: str | None = flag(None, "Model.", required=True)
        steps: int = flag(10)
        ratio: float | None = flag(None)
        fast: bool = flag(False)
        prompts: list[str] | None = flag(None)
        pair: list[str] = flag([], append=True)
        mode: str = flag("a", choices=["a", "b"])

    got = Mine.parse(["--model", "m", "--steps", "3", "--ratio", "2", "--fast", "--prompts", "x", "y",
                      "--pair", "1", "--pair", "2", "--mode", "b"])  # fmt: skip
    assert got == Mine(
        model="m", steps=3, ratio=2.0, fast=True, prompts=["x", "y"], pair=["1", "2"], mode="b"
    )
    assert Mine.parse(["--model", "m"]).pair == [] and Mine.parse(["--model", "m"]).pair is not Mine().pair
    for bad in (
        [],
        ["--model", "m", "--mode", "c"],
        ["--model", "m", "--steps", "x"],
        ["--model", "m", "--prompts"],
    ):
        with pytest.raises(SystemExit):
            Mine.parse(bad)

    @dataclasses.dataclass
    class Wrong(Settings):
        on: bool = flag(True)

    with pytest.raises(TypeError, match="--on must default to False"):
        settings_parser(Wrong)


def test_the_library_reads_settings_by_attribute_never_by_getattr_probe():
    """No ``getattr(args, ...)`` / ``hasattr(args, ...)`` in the package: a setting either is a
    field of the recipe's settings or it is not read (a probe hides a misspelt flag)."""
    probes = []
    for path in (REPO_ROOT / "diffusers_zero3").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and ast.unparse(node.args[0]) in ("args", "self.args", "settings", "self.settings")
            ):
                probes.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)


# ------------------------------------------------------------------ diffusers' scripts' flags (issue 38)

UPSTREAM_FLAGS = REPO_ROOT / "tests" / "data" / "upstream_flags.json"
# Flags another change adds (aspect-ratio buckets, caption dropout, the latent cache, the resize
# filter): owned elsewhere, so this test passes before they land.
OWNED_ELSEWHERE = {
    "use_aspect_ratio_buckets",
    "aspect_ratio_buckets",
    "caption_dropout",
    "cache_latents",
    "image_interpolation_mode",
}
OUR_SCRIPT = {"text_to_image": "train_text_to_image.py", "dreambooth": "train_dreambooth.py",
              "controlnet": "train_controlnet.py"}  # fmt: skip


def _upstream_scripts() -> dict[str, list[str]]:
    import json

    return json.loads(UPSTREAM_FLAGS.read_text())["scripts"]


@pytest.mark.parametrize("upstream", sorted(_upstream_scripts()))
def test_every_flag_of_diffusers_script_is_a_flag_of_ours(upstream):
    """A launch command of diffusers' script (``tests/data/upstream_flags.json``: every flag its
    parser defines, read from the diffusers commit named there) parses with ours: the
    text-to-image scripts map to train_text_to_image.py, DreamBooth's to train_dreambooth.py,
    ControlNet's to train_controlnet.py."""
    from diffusers_zero3.args import settings_parser

    ours = _recipes()[OUR_SCRIPT[upstream.split("/")[1]]]
    flags = {s[2:] for a in settings_parser(ours)._actions for s in a.option_strings}
    missing = set(_upstream_scripts()[upstream]) - flags - OWNED_ELSEWHERE
    assert not missing, f"{upstream}: {sorted(missing)}"


def _t2i(*argv: str):
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    return TextToImageSettings.parse(
        ["--pretrained_model_name_or_path", "p", "--train_data_dir", "d", "--report_to", "none", *argv]
    )


def _dreambooth(*argv: str):
    from diffusers_zero3.recipes.dreambooth import DreamBoothSettings

    return DreamBoothSettings.parse(["--pretrained_model_name_or_path", "p", "--instance_data_dir", "i",
                                     "--instance_prompt", "sks", "--report_to", "none", *argv])  # fmt: skip


def test_every_lr_schedule_gets_num_cycles_and_power_and_they_shape_it():
    """Every ``get_scheduler`` call of the package passes ``--lr_num_cycles`` and ``--lr_power``
    (there is one: ``training.schedule.lr_schedule``, which every trained part's schedule goes
    through); with them diffusers' cosine-with-restarts schedule restarts that many times and
    the polynomial one decays with that power."""
    import torch
    from diffusers.optimization import get_scheduler

    calls = []
    for path in (REPO_ROOT / "diffusers_zero3").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "get_scheduler":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                calls.append(
                    (f"{path.name}:{node.lineno}", keywords.get("num_cycles"), keywords.get("power"))
                )
    assert [where.split(":")[0] for where, *_ in calls] == ["schedule.py"], calls  # the one schedule builder
    for where, cycles, power in calls:
        assert (cycles, power) == ("args.lr_num_cycles", "args.lr_power"), where

    def rates(args, steps=12):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
        schedule = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=steps, num_cycles=args.lr_num_cycles,
                                 power=args.lr_power)  # fmt: skip
        out = []
        for _ in range(steps):
            out.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return out

    args = _t2i("--lr_scheduler", "cosine_with_restarts", "--lr_num_cycles", "3", "--lr_warmup_steps", "0",
                "--learning_rate", "1.0")  # fmt: skip
    assert (args.lr_num_cycles, args.lr_power) == (3, 1.0)
    assert [i for i, lr in enumerate(rates(args)) if lr == 1.0] == [0, 4, 8]  # a restart every 12 / 3 steps
    args = _t2i(
        "--lr_scheduler", "polynomial", "--lr_power", "2", "--lr_warmup_steps", "0", "--learning_rate", "1.0"
    )
    # diffusers' polynomial decay to lr_end 1e-7: (lr - end) * (1 - step / steps) ** power + end
    assert rates(args)[6] == pytest.approx((1.0 - 1e-7) * 0.5**2 + 1e-7)


def test_optimizer_flags_build_adamw_or_prodigy_with_upstreams_settings(monkeypatch):
    """``--optimizer`` (any case) picks the optimizer ``build_optimizer`` makes (``adamw`` is the
    same function); prodigy takes the ``--prodigy_*`` flags, whose booleans take a value
    (``--prodigy_decouple false``) as upstream's ``type=bool`` ones do (where "false" is True).
    Without prodigyopt, or for another optimizer, the flags fail with one line."""
    import importlib.util

    import torch

    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.text_to_image_settings import validate_args
    from diffusers_zero3.training.parts import adamw, build_optimizer

    model = torch.nn.Linear(4, 4)
    default = _t2i()
    assert default.optimizer == "AdamW" and adamw is build_optimizer
    assert type(build_optimizer(model, default)) is torch.optim.AdamW
    args = _t2i("--optimizer", "Prodigy", "--learning_rate", "1.0", "--prodigy_beta3", "0.9",
                "--prodigy_decouple", "false", "--prodigy_use_bias_correction", "FALSE", "--adam_weight_decay", "0.5")  # fmt: skip
    assert (args.prodigy_decouple, args.prodigy_use_bias_correction, args.prodigy_safeguard_warmup) == (
        False,
        False,
        True,
    )
    validate_args(args)
    optimizer = build_optimizer(model, args)
    assert type(optimizer).__name__ == "Prodigy"
    group = optimizer.param_groups[0]
    assert (group["lr"], group["beta3"], group["weight_decay"], group["decouple"]) == (1.0, 0.9, 0.5, False)
    assert (group["use_bias_correction"], group["safeguard_warmup"], group["fsdp_in_use"]) == (
        False,
        True,
        False,
    )
    with pytest.raises(SystemExit):
        _t2i("--prodigy_decouple", "maybe")
    with pytest.raises(ArgumentError, match="--optimizer must be AdamW or prodigy, got 'sgd'"):
        validate_args(_t2i("--optimizer", "sgd"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a)
    )
    with pytest.raises(
        ArgumentError, match=r"needs prodigyopt, which is not installed \(pip install prodigyopt\)"
    ):
        validate_args(args)


def test_prodigy_steps_once_per_update_under_zero3_and_needs_cuda_across_cpu_ranks(monkeypatch):
    """Under ZeRO-3 a Prodigy part gets one optimizer sub-group (DeepSpeed would call its
    ``step`` once per sub-group, each adapting the step size from a slice) and keeps Prodigy
    with an offloaded optimizer; AdamW's config is left alone. Prodigy's all-reduce of its
    estimate across ranks runs on a CUDA tensor: several CPU ranks under ZeRO-3 are refused."""
    import torch

    from diffusers_zero3.args import validate_launch
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.runtime import distributed
    from diffusers_zero3.training.parts import build_optimizer, fit_zero3_config_to_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[1].requires_grad_(False)
    config = {"zero_optimization": {"stage": 3, "sub_group_size": 16}}
    fit_zero3_config_to_optimizer(config, model, build_optimizer(model, _t2i()))
    assert config == {"zero_optimization": {"stage": 3, "sub_group_size": 16}}
    fit_zero3_config_to_optimizer(config, model, build_optimizer(model, _t2i("--optimizer", "prodigy")))
    assert config["zero_optimization"]["sub_group_size"] == 8 * 8 + 8  # the trained parameters
    assert config["zero_force_ds_cpu_optimizer"] is False and config["zero_allow_untested_optimizer"] is True

    args = _t2i("--optimizer", "prodigy")
    validate_launch(args, deepspeed_active=True, on_cpu=True)  # one rank: nothing to sum
    monkeypatch.setattr(distributed, "get_world_size", lambda: 2)
    validate_launch(args, deepspeed_active=False, on_cpu=True)  # DDP: every rank has every parameter
    validate_launch(args, deepspeed_active=True, on_cpu=False)
    with pytest.raises(ArgumentError, match="--optimizer prodigy under ZeRO-3 on several ranks needs CUDA"):
        validate_launch(args, deepspeed_active=True, on_cpu=True)


def test_use_dora_reaches_peft_and_trains_the_magnitudes():
    """``--use_dora`` makes the adapters DoRA (peft's ``LoraConfig(use_dora=True)``): each
    adapted layer gets trainable magnitudes beside its lora_A/lora_B, on a diffusers UNet and a
    transformers text encoder (DreamBooth's). Without ``--rank`` it is refused."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusers_zero3.demo.pipelines import tiny_component_configs
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.families import SD
    from diffusers_zero3.recipes.dreambooth import TEXT_ENCODER_LORA_TARGETS
    from diffusers_zero3.recipes.text_to_image_settings import validate_args
    from diffusers_zero3.training.lora import adapter_shapes, add_lora_adapters

    args = _t2i("--rank", "4", "--use_dora")
    assert args.use_dora
    configs = tiny_component_configs()
    torch.manual_seed(0)
    for model, targets in (
        (UNet2DConditionModel(**configs["unet"]), SD.lora_target_modules),
        (CLIPTextModel(CLIPTextConfig(**configs["text_encoder"])), TEXT_ENCODER_LORA_TARGETS),
    ):
        params = add_lora_adapters(model, rank=args.rank, target_modules=targets, use_dora=args.use_dora)
        assert model.peft_config["default"].use_dora is True
        magnitudes = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
        assert magnitudes and all(p.requires_grad for p in magnitudes.values())
        assert {id(p) for p in magnitudes.values()} <= {id(p) for p in params}
        # the saved state dict's names (peft drops ".default.weight" of a magnitude)
        assert all(k.endswith("lora_magnitude_vector") for k in adapter_shapes(model) if "magnitude" in k)
    unet = UNet2DConditionModel(**configs["unet"])
    add_lora_adapters(unet, rank=4, target_modules=SD.lora_target_modules)
    assert unet.peft_config["default"].use_dora is False
    with pytest.raises(ArgumentError, match="--use_dora applies to LoRA training: add --rank"):
        validate_args(_t2i("--use_dora"))


def test_validation_prompt_joins_the_validation_prompts_of_each_recipe():
    """``--validation_prompt`` (diffusers' SDXL/LoRA/DreamBooth spelling) adds
    ``--num_validation_images`` images of it after ``--validation_prompts``; DreamBooth takes it
    alone; ControlNet pairs its prompts with ``--validation_image`` as before."""
    from diffusers_zero3.errors import ArgumentError

    assert _t2i("--validation_prompt", "c").validation_prompts == ["c"] * 4
    both = _t2i("--validation_prompts", "a", "b", "--validation_prompt", "c", "--num_validation_images", "2")
    assert both.validation_prompts == ["a", "b", "c", "c"]
    assert _t2i("--validation_prompts", "a").validation_prompts == ["a"]
    assert _t2i().validation_prompts is None
    assert _dreambooth("--validation_prompt", "sks dog").validation_prompts == ["sks dog"] * 4
    assert _dreambooth().validation_prompts is None
    with pytest.raises(ArgumentError, match="takes --validation_prompt"):
        _dreambooth("--validation_prompts", "a")
    from diffusers_zero3.recipes.controlnet import ControlNetSettings

    controlnet = ControlNetSettings.parse(["--pretrained_model_name_or_path", "p", "--train_data_dir", "d",
                                           "--validation_prompt", "x", "y", "--validation_image", __file__])  # fmt: skip
    assert controlnet.validation_prompts == ["x", "y"] and controlnet.validation_image == [__file__] * 2


def test_upstream_flags_that_cannot_apply_fail_with_one_line_and_the_others_map():
    """Flags of diffusers' scripts this package cannot honour are accepted by the parser and
    refused with one line saying why when set; the ones it has another spelling for map to it
    (``--tokenizer_name`` to ``--component tokenizer=PATH``, ``--tokenizer_max_length`` to
    ``--max_sequence_length``); ``--set_grads_to_none`` is accepted as it is."""
    from diffusers_zero3.args import component_overrides
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.text_to_image_settings import validate_args

    refused = {
        "--enable_npu_flash_attention": "Ascend NPUs",
        "--debug_loss": "not supported by this script",
    }
    for flag, why in refused.items():
        with pytest.raises(ArgumentError, match=why):
            validate_args(_t2i(flag))
    with pytest.raises(ArgumentError, match="trains the denoiser alone; train_dreambooth.py trains the text"):
        _t2i("--train_text_encoder")
    assert _dreambooth("--train_text_encoder").train_text_encoder
    validate_args(_t2i("--set_grads_to_none"))
    assert component_overrides(_t2i("--tokenizer_name", "tok")) == {"tokenizer": "tok"}

    dreambooth_refused = {
        ("--class_labels_conditioning", "timesteps"): "DeepFloyd IF",
        ("--validation_images", "a.png"): "DeepFloyd IF",
        ("--text_encoder_use_attention_mask",): "as the family's pipeline calls them",
        ("--do_edm_style_training",): "no EDM",
        ("--validation_scheduler", "DDPMScheduler"): "DPM-Solver",
        ("--output_kohya_format",): "applies to LoRA training: add --rank",
        ("--pre_compute_text_embeddings", "--train_text_encoder"): "does not go with --train_text_encoder",
        ("--tokenizer_max_length", "64", "--max_sequence_length", "128"): "disagree",
        ("--repeats", "0"): "--repeats must be a positive number",
    }
    for argv, why in dreambooth_refused.items():
        with pytest.raises(ArgumentError, match=why):
            _dreambooth(*argv)
    assert _dreambooth("--tokenizer_max_length", "64").max_sequence_length == 64
    assert _dreambooth("--output_kohya_format", "--rank", "4", "--skip_save_text_encoder").output_kohya_format


def test_dreambooth_repeats_precomputed_embeddings_and_saved_extras(tmp_path):
    """``--repeats`` counts each instance image that many times in an epoch (class images once);
    ``--pre_compute_text_embeddings`` caches every text encoder of the family (a shard
    placement given contradicts it); ``--skip_save_text_encoder`` leaves the encoders out of the
    saved pipeline; ``--output_kohya_format`` writes the LoRA file in Kohya's keys."""
    import json
    from types import SimpleNamespace

    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from diffusers_zero3.demo.pipelines import tiny_component_configs
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.families import SD, SDXL
    from diffusers_zero3.recipes.dreambooth import (
        DreamBoothPairs,
        DreamBoothTrainer,
        drop_saved_components,
        write_kohya_lora,
    )
    from diffusers_zero3.training.lora import LORA_WEIGHT_NAME, add_lora_adapters

    images = SimpleNamespace(skipped_rows=[], __getitem__=None)
    assert len(DreamBoothPairs(images, 3, 0, repeats=4)) == 12
    assert len(DreamBoothPairs(images, 3, 20, repeats=4)) == 20

    trainer = SimpleNamespace(args=_dreambooth("--pre_compute_text_embeddings"), family=SDXL,
                              placements={"text_encoder": "replicate", "vae": "replicate"})  # fmt: skip
    DreamBoothTrainer._cache_text_encoders(trainer)
    assert trainer.placements == {"text_encoder": "cache", "text_encoder_2": "cache", "vae": "replicate"}
    trainer.args = _dreambooth("--pre_compute_text_embeddings", "--text_encoder_2_placement", "shard")
    with pytest.raises(
        ArgumentError, match="caches text_encoder_2; it contradicts --text_encoder_2_placement shard"
    ):
        DreamBoothTrainer._cache_text_encoders(trainer)

    out = tmp_path / "pipe"
    (out / "text_encoder").mkdir(parents=True)
    (out / "model_index.json").write_text(json.dumps({"text_encoder": ["transformers", "CLIPTextModel"],
                                                      "unet": ["diffusers", "UNet2DConditionModel"]}))  # fmt: skip
    drop_saved_components(out, ["text_encoder"])
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder"] == [None, None] and index["unet"][1] == "UNet2DConditionModel"
    assert not (out / "text_encoder").exists()

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**tiny_component_configs()["unet"])
    add_lora_adapters(unet, rank=4, target_modules=SD.lora_target_modules)
    lora = tmp_path / "lora"
    StableDiffusionPipeline.save_lora_weights(
        lora, unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet)),
        weight_name=LORA_WEIGHT_NAME,
    )  # fmt: skip
    kohya = load_file(str(write_kohya_lora(lora)))
    assert len(kohya) >= len(load_file(str(lora / LORA_WEIGHT_NAME)))
    assert all(k.startswith("lora_unet_") for k in kohya)


def test_controlnet_crop_coordinates_fix_sdxls_crop_micro_conditioning():
    """``--crops_coords_top_left_h/_w`` give every image the same crop corner in SDXL's time ids
    (one given: the other 0, upstream's default); unset, each image keeps its own crop."""
    from types import SimpleNamespace

    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.recipes.controlnet import ControlNetSettings, ControlNetTrainer

    def settings(*argv):
        return ControlNetSettings.parse(
            ["--pretrained_model_name_or_path", "p", "--train_data_dir", "d", *argv]
        )

    assert ControlNetTrainer._fixed_crop(SimpleNamespace(args=settings())) is None
    fixed = ControlNetTrainer._fixed_crop(SimpleNamespace(args=settings("--crops_coords_top_left_h", "8")))
    assert fixed == (8, 0)
    with pytest.raises(ArgumentError, match="--crops_coords_top_left_w must not be negative"):
        settings("--crops_coords_top_left_w", "-1")
