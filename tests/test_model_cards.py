"""Model cards (``state.pipeline_io.model_card``): every family's card names its pipeline class,
calls it as its kind of pipeline does (text-to-image, instruction editing on a source image,
text-to-video), with keywords the class's ``__call__`` takes, and carries no tag of another
kind. The end-to-end tests run the saved cards' snippets as printed (``tests.common.run_card_snippet``:
test_train_text_to_image.py, test_train_families.py for Kontext, test_train_wan.py)."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

pytestmark = pytest.mark.unit


def _families():
    from diffusers_zero3.families import ALL_FAMILIES

    found = {}
    for family in ALL_FAMILIES:
        found[family.name] = family
        editing = family.editing_variant()  # Flux.2 trained on editing pairs: the same class, editing
        if editing is not None:
            found[f"{family.name} (editing pairs)"] = editing
    return found


FAMILIES = _families()


def _card(family) -> str:
    from diffusers_zero3.state.pipeline_io import model_card

    prompt = "make the circle blue" if family.edits else "a red circle"
    call = {"num_inference_steps": 2, **family.size_kwargs(32, 48), **family.validation_kwargs(None, None)}
    return model_card(
        "org/base", "data", {"learning_rate": 1e-4}, [prompt], family.pipeline_class, family.task, call
    )


def _front_matter(card: str) -> dict[str, str]:
    head = card.split("---\n")[1]
    return dict(line.split(": ", 1) for line in head.strip().splitlines())


def _pipe_call(snippet: str) -> ast.Call:
    """The snippet's ``pipe(...)`` call."""
    (call,) = [
        node for node in ast.walk(ast.parse(snippet))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pipe"
    ]  # fmt: skip
    return call


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_card_names_the_pipeline_calls_it_as_its_kind_and_tags_fit(name):
    import diffusers

    family = FAMILIES[name]
    card = _card(family)
    cls = family.pipeline_class
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert f"from diffusers import {cls}\n" in snippet
    assert f'pipe = {cls}.from_pretrained("path/to/this/folder")' in snippet
    meta = _front_matter(card)
    tags = set(meta["tags"].strip("[]").split(", "))
    kinds = {"text-to-image", "image-to-image", "text-to-video"}
    assert meta["pipeline_tag"] == family.task and tags & kinds == {family.task}
    assert ("stable-diffusion" in tags) == cls.startswith("StableDiffusion"), (
        tags
    )  # no SD tag on Flux, Qwen, Wan
    call = _pipe_call(snippet)
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "image"}
    assert not call.args and "prompt" in keywords  # by name: Flux.2's first positional argument is an image
    # every keyword is one the pipeline's own __call__ takes
    accepted = inspect.signature(getattr(diffusers, cls).__call__).parameters
    assert set(keywords) - {"image"} <= set(accepted), set(keywords) - set(accepted)
    title = card.split("\n# ", 1)[1].splitlines()[0]
    if family.edits:
        assert title.startswith("Instruction-editing fine-tune of org/base"), title
        assert 'pipe(image=load_image("source.png"), prompt="make the circle blue"' in snippet
        assert "from diffusers.utils import load_image" in snippet and ".images[0]" in snippet
        assert {"image-editing", "instruction-editing"} <= tags
    elif family.video:
        assert title.startswith("Text-to-video fine-tune"), title
        assert "image=" not in snippet and ".frames[0]" in snippet and "export_to_gif(frames, " in snippet
        assert keywords["output_type"] == "pil"  # what export_to_gif writes
    else:
        assert title.startswith("Text-to-image fine-tune"), title
        assert "image=" not in snippet and ".images[0]" in snippet and "load_image" not in snippet
    assert f"a `{cls}`" in card


def test_card_kinds_follow_the_families_declared_flags():
    from diffusers_zero3.families import FAMILY_NAMES

    assert FAMILY_NAMES["kontext"].task == FAMILY_NAMES["qwenimage-edit"].task == "image-to-image"
    assert FAMILY_NAMES["flux2"].task == "text-to-image"
    assert FAMILY_NAMES["flux2"].editing_variant().task == "image-to-image"
    assert {f.task for f in FAMILY_NAMES.values() if f.video} == {"text-to-video"}
    assert FAMILY_NAMES["sd"].task == "text-to-image"


def test_editing_defaults_validate_with_edit_instructions_on_a_source():
    """``make train MODEL=kontext|qwenimage-edit``: the validation edits the demo's red circle with
    instructions of the demo's editing pairs (``make the <shape> <colour>``)."""
    from diffusers_zero3.demo import COLOURS, SHAPES
    from diffusers_zero3.families import FAMILY_NAMES

    editing = [f for f in FAMILY_NAMES.values() if f.edits]
    assert {f.name for f in editing} >= {"kontext", "qwenimage-edit"}
    for family in editing:
        args = list(family.default_run_args)
        assert args[args.index("--validation_image") + 1] == "{pipeline}-source.png", family.name
        start = args.index("--validation_prompts") + 1
        prompts = args[
            start : next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
        ]
        assert prompts, family.name
        for prompt in prompts:
            words = prompt.split()
            assert words[:2] == ["make", "the"] and words[2] in SHAPES and words[3] in COLOURS, prompt
