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
    from diffusers_zero3.args import TextToImageSettings
    from diffusers_zero3.recipes.controlnet import ControlNetSettings
    from diffusers_zero3.recipes.dpo import DPOSettings
    from diffusers_zero3.recipes.dreambooth import DreamBoothSettings
    from diffusers_zero3.recipes.grpo import GRPOSettings
    from diffusers_zero3.recipes.reward import RewardSettings

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
    from diffusers_zero3.args import settings_parser

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
            if kinds[0] is bool:
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
