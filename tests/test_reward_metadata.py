"""Reward functions that take each prompt's metadata (issue 50, item 8): the signature read once
when the spec is parsed (``fn(images, prompts)`` or ``fn(images, prompts, metadata)``, anything
else one ``ArgumentError`` naming the spec), the composite's ``metadata=`` forwarded to the
functions that take it and to no other reward, and the GenEval-style demo function
``named_colour`` on real tensors."""

from __future__ import annotations

import pytest
import torch

SELF = "tests.test_reward_metadata"
NAMED_COLOUR = "diffusers_zero3.demo.rewards:named_colour"
PROMPTS = ["a red circle", "a blue square", "a photo of a green circle", "the yellow shape"]

# ------------------------------------------------------------------ functions of each signature

SEEN: list[tuple[str, list]] = []  # (function, the metadata it got), in call order


def brightness(images, prompts):
    return images.mean(dim=(1, 2, 3))


def with_metadata(images, prompts, metadata):
    SEEN.append(("with_metadata", metadata))
    return torch.tensor([float(len(m)) for m in metadata])


def with_default_metadata(images, prompts, metadata=None):
    SEEN.append(("with_default_metadata", metadata))
    return torch.tensor([float(m.get("n", 0)) for m in metadata])


def edits_its_metadata(images, prompts, metadata):
    for m in metadata:
        m["edited"] = True
    return torch.zeros(len(images))


def star_args(*args):
    SEEN.append(("star_args", list(args)))
    return args[0].mean(dim=(1, 2, 3))


def one_argument(images):
    return images.mean(dim=(1, 2, 3))


def four_required(images, prompts, metadata, extra):
    return images.mean(dim=(1, 2, 3))


def required_keyword(images, prompts, *, key):
    return images.mean(dim=(1, 2, 3))


def _load(*names_weights):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    return load_rewards(parse_reward_specs([f"{n}={w}" for n, w in names_weights]))


def _solid(colours) -> torch.Tensor:
    """Images ``[B, 3, 8, 8]`` of one RGB colour each (values in ``[0, 1]``)."""
    return torch.tensor(colours, dtype=torch.float32).view(-1, 3, 1, 1).expand(-1, 3, 8, 8).contiguous()


# ------------------------------------------------------------------ the signature


@pytest.mark.unit
def test_the_signature_decides_once_which_functions_take_metadata():
    from diffusers_zero3.rewards import parse_reward_specs

    names = ["brightness", "with_metadata", "with_default_metadata", "star_args"]
    specs = parse_reward_specs([f"{SELF}:{n}" for n in names] + [NAMED_COLOUR])
    assert [s.takes_metadata for s in specs] == [False, True, True, False, True]


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, signature",
    [
        ("one_argument", "(images)"),
        ("four_required", "(images, prompts, metadata, extra)"),
        ("required_keyword", "(images, prompts, *, key)"),
    ],
)
def test_a_function_of_another_signature_is_one_argument_error_naming_the_spec(name, signature):
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.rewards import parse_reward_specs

    with pytest.raises(ArgumentError) as e:
        parse_reward_specs([f"{SELF}:{name}=0.5"])
    assert str(e.value) == (
        f"--reward {SELF}:{name}: a reward function is called fn(images, prompts) or fn(images, prompts,"
        f" metadata), but its signature is {signature}"
    )


# ------------------------------------------------------------------ the composite's metadata=


@pytest.mark.unit
def test_metadata_reaches_the_functions_that_take_it_and_no_other():
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = PROMPTS[:3]
    metadata = [{"n": 2, "color": "red"}, None, {"n": 5}]
    rewards = _load(
        (f"{SELF}:brightness", 1.0),
        (f"{SELF}:edits_its_metadata", 1.0),  # its edits must not reach the next function
        (f"{SELF}:with_metadata", 1.0),
        (f"{SELF}:with_default_metadata", -1.0),
        (f"{SELF}:star_args", 1.0),
    )
    SEEN.clear()
    total, scores = rewards(images, prompts, metadata=metadata)
    expected = [{"n": 2, "color": "red"}, {}, {"n": 5}]
    assert SEEN == [
        ("with_metadata", expected),
        ("with_default_metadata", expected),
        ("star_args", [images, prompts]),  # *args only: the two-argument call, as before
    ]
    assert metadata == [{"n": 2, "color": "red"}, None, {"n": 5}]  # the caller's list untouched
    torch.testing.assert_close(scores[f"{SELF}:with_metadata"], torch.tensor([2.0, 0.0, 1.0]))
    torch.testing.assert_close(scores[f"{SELF}:with_default_metadata"], torch.tensor([2.0, 0.0, 5.0]))
    brightness_scores = brightness(images, prompts)
    torch.testing.assert_close(
        total, 2 * brightness_scores + torch.tensor([2.0, 0.0, 1.0]) - torch.tensor([2.0, 0.0, 5.0])
    )

    # no metadata given: {} per image; the two-argument rewards score as they did
    SEEN.clear()
    total, scores = rewards(images, prompts)
    assert SEEN[:2] == [("with_metadata", [{}, {}, {}]), ("with_default_metadata", [{}, {}, {}])]
    torch.testing.assert_close(total, 2 * brightness_scores)
    # no samples on this rank
    total, scores = rewards(images[:0], [], metadata=[])
    assert total.shape == (0,) and all(s.shape == (0,) for s in scores.values())


@pytest.mark.unit
@pytest.mark.parametrize(
    "metadata, message",
    [
        ([{}, {}], "got 3 images but 2 metadata entries (one dict per image expected)"),
        ([{}, "red", {}], "metadata entry 1 is a str, not a dict"),
    ],
)
def test_metadata_not_one_dict_per_image_is_refused(metadata, message):
    rewards = _load((f"{SELF}:with_metadata", 1.0))
    with pytest.raises(ValueError) as e:
        rewards(torch.rand(3, 3, 8, 8), PROMPTS[:3], metadata=metadata)
    assert str(e.value) == message


@pytest.mark.unit
def test_a_builtin_ignores_the_metadata(tmp_path):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from tests.test_reward_registry import _clip_processor_files, _tiny_clip

    _tiny_clip().save_pretrained(tmp_path)
    _clip_processor_files(tmp_path)
    specs = parse_reward_specs(
        ["clip_score", NAMED_COLOUR], [f"clip_score={tmp_path}"], ["clip_score=replicate"]
    )
    rewards = load_rewards(specs, None, torch.float32)
    images = _solid([[0.9, 0.1, 0.1], [0.1, 0.1, 0.9]])
    plain_total, plain = rewards(images, PROMPTS[:2])
    total, scores = rewards(images, PROMPTS[:2], metadata=[{"color": "blue"}, {"color": "blue"}])
    torch.testing.assert_close(scores["clip_score"], plain["clip_score"])
    torch.testing.assert_close(plain[NAMED_COLOUR], torch.tensor([1.0, 1.0]))  # the prompts' colours
    torch.testing.assert_close(scores[NAMED_COLOUR], torch.tensor([0.0, 1.0]))  # the metadata's
    torch.testing.assert_close(total - plain_total, torch.tensor([-1.0, 0.0]))


# ------------------------------------------------------------------ named_colour


@pytest.mark.unit
def test_named_colour_scores_one_where_the_mean_colour_is_the_one_named():
    from diffusers_zero3.demo.rewards import NAMED_COLOURS, named_colour

    names = list(NAMED_COLOURS)
    images = _solid([NAMED_COLOURS[n] for n in names])
    # each exact palette colour, named in the metadata: 1; named as the next colour: 0
    ones = named_colour(images, None, [{"color": n} for n in names])
    assert ones.dtype == torch.float32 and ones.shape == (10,)
    torch.testing.assert_close(ones, torch.ones(10))
    others = [{"color": names[(i + 1) % 10]} for i in range(10)]
    torch.testing.assert_close(named_colour(images, None, others), torch.zeros(10))

    # noisy images: the mean is what counts (a red image with +-0.1 noise per pixel is red)
    noise = 0.2 * torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)) - 0.1
    noisy = (_solid([[0.85, 0.1, 0.1], [0.1, 0.15, 0.85]]) + noise).clamp(0, 1)
    prompts = ["a photo of a red car", "a photo of a blue bench and a red car"]
    torch.testing.assert_close(named_colour(noisy, prompts, [{}, {}]), torch.tensor([1.0, 1.0]))

    # where the colour comes from: metadata "color", then GenEval's "include", then the prompt
    include = {"include": [{"class": "bench", "count": 1}, {"class": "car", "count": 1, "color": "Blue"}]}
    cases = [
        ({"color": "blue"}, "a red car", 0.0),  # the metadata wins over the prompt
        (include, "a red car", 0.0),
        ({}, "a RED car", 1.0),
        ({}, "a car", 0.0),  # no colour named
        ({"color": "teal"}, "a red car", 0.0),  # not one of the ten
    ]
    red = _solid([[0.9, 0.05, 0.05]] * len(cases))
    expected = torch.tensor([c[2] for c in cases])
    got = named_colour(red, [c[1] for c in cases], [c[0] for c in cases])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(named_colour(1 - red, [c[1] for c in cases], [include] * 5), torch.zeros(5))
    torch.testing.assert_close(
        named_colour(_solid([[0.1, 0.1, 0.9]]), ["a red car"], [include]), torch.ones(1)
    )

    with pytest.raises(ValueError, match="named_colour: got 2 images but 1 metadata entries"):
        named_colour(images[:2], None, [{}])
