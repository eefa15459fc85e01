"""Rewards from their specs, summed with their weights, every output checked.

``load_rewards`` turns the parsed ``RewardSpec`` list into a ``WeightedRewards``: each built-in
model placed through ``prepare_frozen`` with its placement (a ZeRO-3 inference engine for
``shard``) and wrapped in a ``ParallelReward``, each function wrapped as it is. Calling it
scores every rank's own samples with every reward, in the specs' order, so that the sharded
models' forwards stay in lockstep across ranks, then checks the outputs on every rank at once:
a reward that returns the wrong number of scores, a NaN or an inf on any rank (or a function
that raises) is one ``RewardError`` on every rank, instead of a rank that stops while the
others wait in the next collective.

Images are float tensors ``[B, 3, H, W]`` in ``[0, 1]`` on the accelerator's device; each
built-in resizes and normalises them itself, on that device (``rewards.images``). A
``module:function`` whose signature takes a third positional parameter
(``RewardSpec.takes_metadata``) is called ``fn(images, prompts, metadata)``, ``metadata`` one
dict per image (``{}`` where its prompt has none); the others never see the metadata.

Example:
    >>> specs = parse_reward_specs(args.reward, args.reward_model, args.reward_placement)
    >>> rewards = load_rewards(specs, accelerator, torch.bfloat16)     # every rank; built-ins in fp32
    >>> images = (vae.decode(latents).sample / 2 + 0.5).clamp(0, 1)  # [B, 3, H, W] in [0, 1]
    >>> total, scores = rewards(images, prompts)                     # every rank, B may be 0
    >>> total, scores = rewards(images, prompts, metadata=[{"color": "red"}] * len(images))
    >>> scores["pickscore"].shape, total.shape
    (torch.Size([B]), torch.Size([B]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RewardError
from ..placement.frozen import load_frozen_component, prepare_frozen
from ..placement.rewards import ParallelReward
from ..runtime.distributed import all_gather_object, is_distributed
from ..runtime.ds_config import base_config, resolve_dtype
from ..runtime.zero3 import zero3_init_disabled
from ..state.pretrained import load_pretrained_zero3, resolve_model_folder
from .builtin import BUILTINS
from .groupwise import GroupwiseReward, SampleGroups
from .specs import RewardSpec

if TYPE_CHECKING:
    from accelerate import Accelerator


class MetadataRewardFunction:
    """A reward function ``fn(images, prompts, metadata)`` called as ``(images, prompts)``, the
    way ``ParallelReward`` calls a function: ``given(metadata)`` sets the metadata of the calls
    made inside it (``WeightedRewards`` enters it around each call; ``{}`` per image outside).

    Args:
        fn: the user's function; ``metadata`` is a list of dicts, one per image.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.metadata: list[dict] | None = None

    @contextlib.contextmanager
    def given(self, metadata: list[dict]) -> Iterator[None]:
        """The metadata of the calls inside the block (restored on the way out, even on error)."""
        previous, self.metadata = self.metadata, metadata
        try:
            yield
        finally:
            self.metadata = previous

    def __call__(self, images: torch.Tensor, prompts: Sequence[str] | None) -> Any:
        """``fn(images, prompts, metadata)``: the metadata set by ``given`` (a copy of each dict,
        so that one function's edits do not reach the next), ``{}`` per image when none is."""
        metadata = self.metadata if self.metadata is not None else [{}] * len(images)
        return self.fn(images, prompts, [dict(m) for m in metadata])


def metadata_rows(metadata: Sequence[Mapping[str, Any] | None] | None, n: int) -> list[dict]:
    """One dict per image of ``metadata`` (None, or None entries: ``{}``).

    Raises:
        ValueError: ``metadata`` is not one entry per image, or an entry is not a dict.
    """
    if metadata is None:
        return [{} for _ in range(n)]
    if len(metadata) != n:
        raise ValueError(f"got {n} images but {len(metadata)} metadata entries (one dict per image expected)")
    rows = []
    for i, m in enumerate(metadata):
        if m is not None and not isinstance(m, Mapping):
            raise ValueError(f"metadata entry {i} is a {type(m).__name__}, not a dict")
        rows.append(dict(m or {}))
    return rows


def frame_indices(num_frames: int, count: int) -> list[int]:
    """``count`` frames of a clip of ``num_frames``, evenly spaced from the first to the last
    (rounded; each once); every frame for ``count`` 0 or ``count >= num_frames``."""
    if count <= 0 or count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [0]
    return sorted({round(i * (num_frames - 1) / (count - 1)) for i in range(count)})


def score_frames(
    reward: Callable[..., torch.Tensor], videos: torch.Tensor, prompts: Sequence[str] | None, frames: int
) -> torch.Tensor:
    """A clip's reward from an image reward: ``reward`` (called ``reward(images, prompts)``) on
    ``frame_indices(F, frames)`` of each clip of ``videos`` ``[B, F, 3, H, W]``, each frame with
    its clip's prompt, and the mean over a clip's frames (``[B]``). Collective when ``reward``
    is (every rank makes the same calls: ``B x frames`` images, B may be 0)."""
    chosen = frame_indices(videos.shape[1], frames)
    images = videos[:, chosen].flatten(0, 1)
    repeated = None if prompts is None else [p for p in prompts for _ in chosen]
    scores = reward(images, repeated)
    if not torch.is_tensor(scores) or scores.numel() != len(images):
        got = tuple(scores.shape) if torch.is_tensor(scores) else type(scores).__name__
        raise ValueError(
            f"returned {got} for {len(videos)} clips x {len(chosen)} frames (one score per frame expected)"
        )
    return scores.reshape(len(videos), len(chosen)).mean(dim=1)


@dataclass(frozen=True)
class ClipScoring:
    """How rewards score clips ``[B, F, 3, H, W]``: an image reward through ``frames`` of each
    clip's frames (``score_frames``; 0: every frame), a judge of whole clips (``takes_videos``)
    at the clips' frame rate ``fps`` (it samples their frames by time; None: its default)."""

    frames: int = 0
    fps: float | None = None


class WeightedRewards:
    """Several rewards and their weights: ``total = sum(weight * scores)``.

    Args:
        rewards: ``{spec name: ParallelReward or GroupwiseReward}``, in the order they are
            called. A ``GroupwiseReward`` scores a prompt's group together: the call then needs
            ``groups`` (which group and member each sample is) and every sample of the round.
        weights: ``{spec name: weight}``.
        video_rewards: the names that score whole clips (``RewardSpec.takes_videos``); the
            others score a clip through ``frames`` of its frames (``score_frames``).
        frames: frames an image reward sees of a clip (``ClipScoring.frames``; 0: every frame).

    Collective: call on every rank, each with its own samples (zero included).
    """

    def __init__(
        self,
        rewards: dict[str, ParallelReward | GroupwiseReward],
        weights: dict[str, float],
        *,
        video_rewards: frozenset[str] = frozenset(),
        frames: int = 0,
    ):
        if set(rewards) != set(weights):
            raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} name different specs")
        self.rewards = rewards
        self.weights = weights
        self.video_rewards = video_rewards
        self.frames = frames

    @property
    def groupwise(self) -> list[str]:
        """The names of the group-wise rewards (called with ``groups``, on a whole round)."""
        return [name for name, r in self.rewards.items() if isinstance(r, GroupwiseReward)]

    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str] | None = None,
        *,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        groups: SampleGroups | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score this rank's samples with every reward.

        Args:
            images: float ``[B, 3, H, W]`` in ``[0, 1]``, or clips ``[B, F, 3, H, W]``, on
                the accelerator's device; ``B`` may differ between ranks and be 0.
            prompts: one prompt per image (the prompt-free rewards ignore them).
            metadata: one dict per image, its prompt's metadata (e.g. a JSONL prompt file's
                other fields; None or a None entry: ``{}``). Passed as a list of dicts to the
                functions that take it (``MetadataRewardFunction``); the built-ins, models and
                two-argument functions ignore it.
            groups: each sample's prompt group, member and whether it is real (dummies join
                no group); needed when a reward is group-wise, which then sees every rank's
                samples of the call (pass the whole round in one call).

        Returns:
            ``(total, scores)``: ``total`` ``[B]`` float32, the weighted sum; ``scores`` ``{spec
            name: [B] float32}``, each reward's own scores, on the images' device.

        Raises:
            RewardError: on every rank, when any rank's reward returned a wrong number of
                scores, NaN or inf, or raised (one line naming each reward and what is wrong).

        Collective: call on every rank.
        """
        if prompts is not None and len(prompts) != len(images):
            raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
        n = len(images)
        rows = metadata_rows(metadata, n)
        clips = torch.is_tensor(images) and images.ndim == 5
        if clips and self.groupwise:
            raise ValueError(f"the group-wise rewards {', '.join(self.groupwise)} judge images, not clips")
        if self.groupwise and groups is None:
            raise ValueError(
                f"the group-wise rewards {', '.join(self.groupwise)} need groups= (each sample's prompt group and member)"
            )
        scores: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        raised: Exception | None = None
        for name, reward in self.rewards.items():
            fn = reward.fn
            by_frame = clips and name not in self.video_rewards
            # an image reward's metadata rows follow the frames it scores: one row per frame
            each = (
                [r for r in rows for _ in frame_indices(images.shape[1], self.frames)] if by_frame else rows
            )
            given = fn.given(each) if isinstance(fn, MetadataRewardFunction) else contextlib.nullcontext()
            try:
                with given:
                    if isinstance(reward, GroupwiseReward):
                        out = reward(images, prompts, groups)
                    elif by_frame:
                        out = score_frames(reward, images, prompts, self.frames)
                    else:
                        out = reward(images, prompts)
            except Exception as e:  # reported on every rank below; the next rewards are still called
                problems.append(f"reward '{name}' raised {type(e).__name__}: {' '.join(str(e).split())}")
                raised = raised or e
                continue
            problem = _check_scores(out, n)
            if problem:
                problems.append(f"reward '{name}' {problem}")
            else:
                scores[name] = out.float()
        raise_reward_problems(problems, cause=raised)
        device = images.device if torch.is_tensor(images) else None
        total = torch.zeros(n, dtype=torch.float32, device=device)
        for name, s in scores.items():
            total = total + self.weights[name] * s.to(total.device)
        return total, scores

    @contextlib.contextmanager
    def lockstep_check(self) -> Iterator[None]:
        """A debug check over every sharded reward model's forwards: a rank calling one out of
        lockstep raises ``LockstepError`` instead of hanging (``ParallelReward.lockstep_check``).

        Collective: enter and leave on every rank.
        """
        with contextlib.ExitStack() as stack:
            for reward in self.rewards.values():
                stack.enter_context(reward.lockstep_check())
            yield


def _check_scores(scores: torch.Tensor, n: int) -> str | None:
    """What is wrong with a reward's ``scores`` for ``n`` samples, or None."""
    if not torch.is_tensor(scores) or scores.dim() != 1 or len(scores) != n:
        got = f"shape {tuple(scores.shape)}" if torch.is_tensor(scores) else type(scores).__name__
        return f"returned {got} for {n} samples (one score per sample expected)"
    nan = int(torch.isnan(scores).sum())
    inf = int(torch.isinf(scores).sum())
    if nan or inf:
        what = " and ".join(
            w for w in (f"NaN for {nan}" if nan else "", f"inf for {inf}" if inf else "") if w
        )
        return f"returned {what} of {n} samples"
    return None


def raise_reward_problems(problems: list[str], cause: BaseException | None = None) -> None:
    """Raise one ``RewardError`` on every rank when any rank has a problem.

    Args:
        problems: this rank's problems, one line each (``"reward 'x' returned NaN ..."``).
        cause: this rank's exception behind them, chained to the error here.

    Collective: call on every rank (one small ``all_gather_object`` under a process group).
    """
    gathered = all_gather_object(problems) if is_distributed() else [problems]
    lines = []
    for rank, rank_problems in enumerate(gathered):
        lines += [f"{p} on rank {rank}" if len(gathered) > 1 else p for p in rank_problems]
    if lines:
        raise RewardError("; ".join(lines)) from cause


def partitioned_loader(accelerator: Accelerator | None, placement: str):
    """``load(cls, path, dtype)``: ``load_pretrained_zero3`` into partitions in the
    accelerator's memory (``shard``) or host memory (``offload``). Collective (the returned
    function): call on every rank."""

    def load(cls: type, path, dtype: torch.dtype | None) -> torch.nn.Module:
        return load_pretrained_zero3(
            cls, path, accelerator=accelerator, torch_dtype=dtype, offload_param=placement == "offload"
        )

    return load


def load_rewards(
    specs: Sequence[RewardSpec],
    accelerator: Accelerator | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    micro_batch_size: int = 8,
    differentiable: bool = False,
    normalize: str | None = None,
    vlm_question: str | None = None,
    clips: ClipScoring = ClipScoring(),
) -> WeightedRewards:
    """Load and place every reward of ``specs``.

    A ``module:Class`` model and the VLM judges under ``shard``/``offload`` are read straight
    into partitions (``load_pretrained_zero3``: no rank ever holds them whole); the CLIP-sized
    built-ins are loaded whole (``zero3_init_disabled``) and then partitioned parameter by
    parameter by ``prepare_frozen``; ``replicate`` is a copy on every rank. Functions are used
    as they are (called on every rank with that rank's samples); one that takes metadata
    (``RewardSpec.takes_metadata``) is wrapped in a ``MetadataRewardFunction``.

    Args:
        specs: from ``parse_reward_specs``.
        accelerator: the training accelerator (device, DeepSpeed config, mixed precision);
            None: one CPU process.
        dtype: the dtype of ``module:Class`` reward models and of the ``vlm`` judge (default:
            the accelerator's mixed precision); the other built-ins score in fp32 whatever it
            is (``BuiltinReward.dtype``).
        micro_batch_size: samples per reward-model forward.
        differentiable: let gradients flow from the scores into the images (see
            ``ParallelReward``).
        vlm_question: the ``vlm`` judge's question (``{prompt}`` stands for the image's
            prompt; default ``builtin.DEFAULT_VLM_QUESTION``).
        normalize: each reward's normalisation before the weighted sum (``ParallelReward``'s
            ``normalize``: None, ``"batch"`` or ``"per_prompt"``, over every rank's samples).
        clips: how clips are scored (``ClipScoring``: the frames an image reward sees, the
            frame rate a built-in judge of whole clips is given).

    Returns:
        The rewards and their weights, called as ``rewards(images, prompts)`` or
        ``rewards(images, prompts, metadata=[{...}, ...])``.

    Collective: call on every rank, in the same order relative to other engines (a sharded
    reward builds a DeepSpeed engine).
    """
    dtype = resolve_dtype(dtype, base_config(None, accelerator), accelerator)
    rewards: dict[str, ParallelReward] = {}
    weights: dict[str, float] = {}
    for spec in specs:
        if spec.model_class is not None:
            folder = resolve_model_folder(spec.model_path)
            frozen = load_frozen_component(
                accelerator,
                folder.parent,
                folder.name,
                spec.placement,
                spec.model_class,
                dtype=dtype,
                label=f"reward {spec.name}",
            )
        elif spec.is_builtin:
            builtin = BUILTINS[spec.name]
            # fp32 whatever the run's dtype (BuiltinReward.dtype): weights, inputs (ParallelReward
            # casts them to the model's dtype) and the score, as the references score
            model_dtype = builtin.dtype or dtype
            kwargs = {"question": vlm_question} if builtin.takes_question and vlm_question else {}
            if builtin.takes_videos and clips.fps is not None:
                kwargs["video_fps"] = clips.fps
            if builtin.partitioned_load and spec.placement in ("shard", "offload"):
                # the judge read straight into partitions: a 7-72 B model never whole on a rank
                kwargs["load_model"] = partitioned_loader(accelerator, spec.placement)
                module = builtin.load(spec.model_path, model_dtype, **kwargs)
            else:
                with zero3_init_disabled():
                    module = builtin.load(spec.model_path, model_dtype, **kwargs)
            frozen = prepare_frozen(
                module, spec.placement, accelerator=accelerator, dtype=model_dtype, name=f"reward {spec.name}"
            )
        if spec.has_model:
            reward = ParallelReward(
                frozen,
                accelerator=accelerator,
                micro_batch_size=micro_batch_size,
                preprocess=getattr(
                    frozen.module, "preprocess", None
                ),  # a model class may take images as they are
                differentiable=differentiable,
                normalize=normalize,
            )
        else:
            fn = MetadataRewardFunction(spec.function) if spec.takes_metadata else spec.function
            reward = ParallelReward(fn, accelerator=accelerator, normalize=normalize)
        if spec.is_groupwise:
            if differentiable:
                raise ValueError(f"reward {spec.name} is group-wise ({spec.scope}): it is not differentiable")
            reward.normalize = None  # its outputs are a judge's preferences or a group's own scores
            reward = GroupwiseReward(reward, spec.scope)
        rewards[spec.name] = reward
        weights[spec.name] = spec.weight
    videos = frozenset(s.name for s in specs if s.takes_videos)
    return WeightedRewards(rewards, weights, video_rewards=videos, frames=clips.frames)
