"""The reward flags of a command line, parsed into one typed list of ``RewardSpec``.

* ``--reward SPEC[=WEIGHT]`` (repeatable): ``SPEC`` is a built-in name (``pickscore``,
  ``pickscore_logit``, ``clip_score``, ``clip_score_100``, ``aesthetic``, ``vlm``, ``hpsv2``,
  ``imagereward``, ``hpsv3``, ``unifiedreward``, ``pairwise_vlm``; see ``rewards.builtin``), ``module:function``,
  a function ``fn(images, prompts) -> scores`` (one number per image) or ``fn(images, prompts,
  metadata) -> scores`` (``metadata``: one dict per image, ``{}`` where its prompt has none;
  which of the two is read once from the function's signature, ``function_takes_metadata``), or
  ``module:Class``, a reward model class with ``from_pretrained`` (its weights from
  ``--reward_model``); ``WEIGHT`` its weight in the sum (default 1.0). A function or class that
  declares ``reward_scope`` ``"group"`` or ``"pairwise"`` (``rewards.groupwise``) scores a prompt's
  whole group together.
* ``--reward_model NAME=PATH_OR_HUB_ID`` (repeatable): the weights of the built-in ``NAME``.
* ``--reward_placement NAME=shard|replicate|offload`` (repeatable): where a built-in's model
  lives (default ``shard``: a ZeRO-3 inference engine, see ``placement.frozen``).

Every mistake is one ``ArgumentError`` naming the flag and the value.

Example:
    >>> specs = parse_reward_specs(
    ...     ["pickscore=1.0", "aesthetic=0.5", "my_rewards:ocr"],
    ...     ["pickscore=yuvalkirstain/PickScore_v1", "aesthetic=/models/laion-aesthetic"],
    ...     ["aesthetic=replicate"],
    ... )
    >>> [(s.name, s.weight, s.placement) for s in specs]
    [('pickscore', 1.0, 'shard'), ('aesthetic', 0.5, 'replicate'), ('my_rewards:ocr', 1.0, None)]
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ArgumentError
from ..placement.frozen import PLACEMENTS
from .builtin import BUILTINS
from .groupwise import reward_scope

DEFAULT_PLACEMENT = "shard"


@dataclass(frozen=True)
class RewardSpec:
    """One reward of the weighted sum.

    Attributes:
        name: the built-in name, ``module:function`` or ``module:Class``, as given (the key of
            its scores).
        weight: its weight in the sum.
        model_path: a model's weights (a folder or hub id); None for a function.
        placement: a model's placement (``shard``, ``replicate`` or ``offload``); None for a
            function, which runs as it is on every rank.
        function: the imported function of a ``module:function`` reward.
        takes_metadata: the function is called ``fn(images, prompts, metadata)`` (three
            positional parameters), not ``fn(images, prompts)``; False for a model.
        model_class: the imported class of a ``module:Class`` reward: a ``torch.nn.Module``
            with ``from_pretrained`` (a diffusers ``ModelMixin`` or a transformers model) whose
            forward maps images (or its ``preprocess(images, prompts)``'s output) to one score
            each, loaded from ``--reward_model`` straight into its placement.
        scope: ``"sample"`` (one score per image from that image alone), ``"group"`` (scores a
            prompt's whole group together) or ``"pairwise"`` (a judge of two images: each
            image's reward is its win rate in its group); read from the function's or class's
            ``reward_scope`` (``rewards.groupwise``) or the built-in's.
        takes_videos: it scores whole clips ``[B, F, 3, H, W]`` (a built-in's ``takes_videos``,
            or a function's or class's ``takes_videos = True`` attribute); the others score a
            clip through its frames (``rewards.registry.score_frames``).
    """

    name: str
    weight: float = 1.0
    model_path: str | None = None
    placement: str | None = None
    function: Callable[..., Any] | None = field(default=None, repr=False, compare=False)
    takes_metadata: bool = False
    model_class: type | None = field(default=None, repr=False, compare=False)
    scope: str = "sample"
    takes_videos: bool = False

    @property
    def is_groupwise(self) -> bool:
        """True for a reward that scores a prompt's group together (``group`` or ``pairwise``):
        the trainer gathers the group's images for it (``rewards.groupwise``)."""
        return self.scope != "sample"

    @property
    def is_builtin(self) -> bool:
        """True for a built-in reward model, False for a ``module:function`` or ``module:Class``."""
        return self.function is None and self.model_class is None

    @property
    def has_model(self) -> bool:
        """True for a reward model (built-in or ``module:Class``): placed, called in lockstep."""
        return self.function is None


def _pairs(flag: str, values: Sequence[str], value_name: str) -> dict[str, str]:
    """``{NAME: VALUE}`` of ``NAME=VALUE`` items; a malformed or repeated name is an error."""
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ArgumentError(f"{flag} {item!r}: expected NAME={value_name}")
        if name in out:
            raise ArgumentError(f"{flag} {name} is given twice ({out[name]!r} and {value!r})")
        out[name] = value
    return out


def _weight(item: str, text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight):
        raise ArgumentError(f"--reward {item!r}: the weight {text!r} is not a number")
    return weight


def import_reward_function(spec: str) -> Callable[..., Any]:
    """The function of a ``module:function`` reward; ``ArgumentError`` when the module does not
    import, has no such attribute, or it is not callable."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ArgumentError(f"--reward {spec!r}: expected a built-in name or module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of the user's module is the user's to fix
        raise ArgumentError(
            f"--reward {spec}: module {module_name!r} does not import ({type(e).__name__}: {e})"
        ) from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ArgumentError(f"--reward {spec}: module {module_name!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ArgumentError(f"--reward {spec}: {attr!r} is a {type(fn).__name__}, not a function")
    if isinstance(fn, type) and not (issubclass(fn, torch.nn.Module) and hasattr(fn, "from_pretrained")):
        raise ArgumentError(
            f"--reward {spec}: {attr!r} is a class but not a model with from_pretrained (a diffusers "
            "ModelMixin or a transformers model)"
        )
    return fn


def function_takes_metadata(spec: str, fn: Callable[..., Any]) -> bool:
    """Whether the reward function ``fn`` of ``--reward spec`` takes each image's metadata.

    A reward function is called with two positional arguments, ``fn(images, prompts)``, or
    three, ``fn(images, prompts, metadata)``. This reads which from its signature, once, when the
    spec is loaded: three when it has at least three positional parameters (``metadata`` may
    have a default), two otherwise (a function of two, or of ``*args`` only, works unchanged).
    A callable whose signature cannot be read (some C functions) is called with two.

    Args:
        spec: the ``--reward`` name (``module:function``), for the error message.
        fn: the imported function.

    Returns:
        True for ``fn(images, prompts, metadata)``, False for ``fn(images, prompts)``.

    Raises:
        ArgumentError: a signature that takes neither call: fewer than two positional
            parameters (and no ``*args``), more than three without defaults, or a keyword-only
            parameter without a default.

    Example:
        >>> function_takes_metadata("m:f", lambda images, prompts: images.mean((1, 2, 3)))
        False
        >>> function_takes_metadata("m:g", lambda images, prompts, metadata=None: images.mean((1, 2, 3)))
        True
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the two-argument call, as before
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = signature.parameters.values()
    positional = [p for p in params if p.kind in kinds]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    keyword_only = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]
    if (len(positional) < 2 and not varargs) or len(required) > 3 or keyword_only:
        raise ArgumentError(
            f"--reward {spec}: a reward function is called fn(images, prompts) or fn(images, prompts,"
            f" metadata), but its signature is {signature}"
        )
    return len(positional) >= 3


def _scope(name: str, obj: Any) -> str:
    """The ``reward_scope`` ``obj`` declares; a bad one is an ``ArgumentError``."""
    try:
        return reward_scope(obj)
    except ValueError as e:
        raise ArgumentError(f"--reward {name}: {e}") from e


def declares_videos(obj: Any) -> bool:
    """Whether a reward function or class declares ``takes_videos = True``: it is given whole
    clips ``[B, F, 3, H, W]`` in ``[0, 1]`` instead of their frames."""
    return getattr(obj, "takes_videos", False) is True


def _builtin(name: str) -> None:
    """Raise ``ArgumentError`` for a name that is no built-in."""
    builtin = BUILTINS.get(name)
    if builtin is None:
        raise ArgumentError(
            f"--reward {name}: unknown built-in reward; choose one of {', '.join(sorted(BUILTINS))},"
            " or give a function as module:function"
        )


def parse_reward_specs(
    rewards: Sequence[str], models: Sequence[str] = (), placements: Sequence[str] = ()
) -> list[RewardSpec]:
    """The rewards of ``--reward``, ``--reward_model`` and ``--reward_placement``, checked.

    Args:
        rewards: the ``--reward`` values, ``SPEC`` or ``SPEC=WEIGHT``.
        models: the ``--reward_model`` values, ``NAME=PATH_OR_HUB_ID``.
        placements: the ``--reward_placement`` values, ``NAME=shard|replicate|offload``.

    Returns:
        One ``RewardSpec`` per ``--reward``, in order (functions imported).

    Raises:
        ArgumentError: an unknown built-in or one that is not available; a ``module:function``
            that does not import, is not callable or has a signature that takes neither
            ``(images, prompts)`` nor ``(images, prompts, metadata)``; a weight that is not a number; a reward
            given twice; a model or placement for a reward not given with ``--reward``, or for
            a function; a built-in without its ``--reward_model``; an unknown placement.
    """
    model_of = _pairs("--reward_model", models, "PATH_OR_HUB_ID")
    placement_of = _pairs("--reward_placement", placements, "|".join(PLACEMENTS))
    specs: list[RewardSpec] = []
    for item in rewards:
        name, weight = item, 1.0
        if "=" in item:
            name, _, text = item.rpartition("=")
            weight = _weight(item, text)
        if not name:
            raise ArgumentError(f"--reward {item!r}: expected SPEC or SPEC=WEIGHT")
        if any(s.name == name for s in specs):
            raise ArgumentError(f"--reward {name} is given twice")
        model_class = None
        if ":" in name:
            function = import_reward_function(name)
            if not isinstance(function, type):
                for flag, given in (("--reward_model", model_of), ("--reward_placement", placement_of)):
                    if name in given:
                        raise ArgumentError(f"{flag} {name}: a function reward has no model to load or place")
                takes_metadata = function_takes_metadata(name, function)
                scope = _scope(name, function)
                if scope != "sample" and takes_metadata:
                    raise ArgumentError(
                        f"--reward {name}: a {scope} reward is called fn(images, prompts), without metadata"
                    )
                specs.append(
                    RewardSpec(
                        name,
                        weight,
                        function=function,
                        takes_metadata=takes_metadata,
                        scope=scope,
                        takes_videos=declares_videos(function),
                    )  # fmt: skip
                )
                continue
            model_class = function
            if name not in model_of:
                raise ArgumentError(
                    f"--reward {name} needs its weights: --reward_model {name}=PATH_OR_HUB_ID"
                )
        else:
            _builtin(name)
        if name not in model_of:
            raise ArgumentError(
                f"--reward {name} needs its weights: --reward_model {name}=PATH_OR_HUB_ID"
                f" (published: {BUILTINS[name].published})"
            )
        placement = placement_of.get(name, DEFAULT_PLACEMENT)
        if placement not in PLACEMENTS:
            raise ArgumentError(
                f"--reward_placement {name}={placement}: choose one of {', '.join(PLACEMENTS)}"
            )
        scope = _scope(name, model_class) if model_class is not None else BUILTINS[name].scope
        specs.append(
            RewardSpec(
                name,
                weight,
                model_path=model_of[name],
                placement=placement,
                model_class=model_class,
                scope=scope,
                takes_videos=declares_videos(model_class)
                if model_class is not None
                else BUILTINS[name].takes_videos,
            )
        )
    given = {s.name for s in specs}
    for flag, named in (("--reward_model", model_of), ("--reward_placement", placement_of)):
        for name in named:
            if name not in given:
                listed = ", ".join(s.name for s in specs) or "none"
                raise ArgumentError(f"{flag} {name}: no such reward given with --reward (given: {listed})")
    return specs
