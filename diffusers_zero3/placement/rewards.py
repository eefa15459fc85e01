"""A reward function called on every rank with that rank's own samples, never hanging.

trlx calls ``reward_fn`` on rank 0 only (gather, score, scatter), which hangs as soon as the
reward model is itself sharded: its forward all-gathers parameters from every rank, and the
other ranks are not calling it (CarperAI/trlx#574). ``ParallelReward`` shards the reward
model as a ZeRO-3 inference engine and has every rank score its own samples, padding ranks
with fewer micro-batches with dummy ones so that every rank makes the same number of
forward (and, with ``differentiable=True``, backward) passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.distributed import all_gather_object, comm_device, get_rank, is_distributed
from ..runtime.lockstep import lockstep_map
from .frozen import FrozenModel, prepare_frozen

NORMALIZE_MODES = (None, "batch", "per_prompt", "reference")
_EPS = 1e-8


class ParallelReward:
    """Score samples with a reward model or function on every rank.

    Args:
        reward_model_or_fn: a ``torch.nn.Module`` (its forward maps a batch of inputs to one
            score per sample), a ``FrozenModel`` already placed, or a plain function
            ``fn(images, prompts) -> scores`` (an API call, a heuristic).
        accelerator: for the training config, device and mixed precision of the engine.
        placement: ``"shard"`` (a ZeRO-3 inference engine through ``prepare_frozen``) or
            ``"replicate"``; ignored for a function or a ``FrozenModel``. A module with its own
            DeepSpeed config, dtype or name: place it with ``prepare_frozen`` and pass the
            ``FrozenModel`` (its name labels the lockstep calls).
        micro_batch_size: samples per reward-model forward.
        mode: ``"all_ranks"`` (each rank scores its own samples) or ``"main_process"``
            (gather to rank 0, score there, scatter back in the original order: for plain
            functions; refused for a sharded model, which would hang).
        normalize: None; ``"batch"`` ((r - mean) / std over every rank's samples);
            ``"per_prompt"`` (the same, per prompt across ranks); ``"reference"``
            (``r(sample) - r(reference)`` for ``reference_images`` passed to the call). Means
            and standard deviations (population, +1e-8) are constants for gradients.
        preprocess: ``fn(images, prompts) -> model inputs``, applied before micro-batching.
        differentiable: let gradients flow from the rewards into the images (through the
            engine's module). Every rank must then backpropagate through the returned
            rewards (ranks with no samples included: use ``rewards.sum() * 0`` there).

    Collective: call on every rank, each with its own samples (zero included).

    Example:
        >>> reward = ParallelReward(reward_model, accelerator=accelerator, placement="shard")
        >>> scores = reward(images, prompts)            # this rank's scores, shape [len(images)]
    """

    def __init__(
        self,
        reward_model_or_fn: torch.nn.Module | FrozenModel | Callable[..., Any],
        *,
        accelerator=None,
        placement: str = "shard",
        micro_batch_size: int = 8,
        mode: str = "all_ranks",
        normalize: str | None = None,
        preprocess: Callable[[Any, Sequence[str] | None], Any] | None = None,
        differentiable: bool = False,
    ):
        if mode not in ("all_ranks", "main_process"):
            raise ValueError(f"mode must be 'all_ranks' or 'main_process', got {mode!r}")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be at least 1")
        self.mode, self.normalize, self.preprocess = mode, normalize, preprocess
        self.micro_batch_size, self.differentiable = micro_batch_size, differentiable
        if isinstance(reward_model_or_fn, torch.nn.Module):
            reward_model_or_fn = prepare_frozen(
                reward_model_or_fn, placement, accelerator=accelerator, name="reward"
            )
        self.model = reward_model_or_fn if isinstance(reward_model_or_fn, FrozenModel) else None
        self.fn = None if self.model is not None else reward_model_or_fn
        self.name = self.model.name if self.model is not None else "reward"
        # Where scores land when the images are not tensors (a list of PIL images): the
        # accelerator's device, so that a following ``accelerator.gather`` (NCCL) takes them.
        self.device = accelerator.device if accelerator is not None else torch.device("cpu")
        if mode == "main_process" and self.model is not None and self.model.is_sharded:
            raise ValueError(
                f"mode='main_process' cannot score with the sharded reward model '{self.name}': its forward all-gathers"
                " parameters from every rank, but only rank 0 would be calling it, so rank 0 would wait forever"
                " (the trlx hang, CarperAI/trlx#574). Use mode='all_ranks' (each rank scores its own samples),"
                " or placement='replicate'."
            )
        if mode == "main_process" and differentiable:
            raise ValueError("differentiable=True needs mode='all_ranks': gradients cannot cross the gather")

    # ------------------------------------------------------------------ scoring

    def _inputs(self, images, prompts):
        return self.preprocess(images, prompts) if self.preprocess is not None else images

    def _scores_device(self, images) -> torch.device:
        """The device of the images when they are a tensor, else the accelerator's."""
        return images.device if torch.is_tensor(images) else self.device

    def _model_input(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` on the reward model's device, floating point cast to its dtype: the model
        is cast to the training dtype (bf16), the decoded images are fp32, and a convolution
        refuses the mix; rank 0 of ``main_process`` mode gets every rank's images on the CPU."""
        param = next(iter(self.model.module.parameters()), None)
        if param is None:
            return batch
        dtype = param.dtype if batch.is_floating_point() else batch.dtype
        return batch.to(param.device, dtype)

    def _score_local(self, images, prompts, lockstep: bool = True) -> torch.Tensor:
        """Scores of this rank's samples.

        With ``lockstep`` (collective) every rank makes the same number of model calls;
        without it (rank 0 alone, in main-process mode) the model is simply called per
        micro-batch, with no collective at all.
        """
        inputs = self._inputs(images, prompts)
        device = self._scores_device(images)
        if self.model is None:
            scores = torch.as_tensor(self.fn(inputs, prompts), dtype=torch.float32, device=device)
            return scores.reshape(-1)
        chunks = list(torch.split(inputs, self.micro_batch_size)) if len(inputs) else []

        def score(batch: torch.Tensor) -> torch.Tensor:
            return self.model(self._model_input(batch)).reshape(-1).float().to(device)

        if not lockstep:
            with torch.no_grad():
                return torch.cat([score(c) for c in chunks]) if chunks else torch.zeros(0, device=device)
        if not self.differentiable:
            with torch.no_grad():
                outs = lockstep_map(score, chunks, name=self.name)
            return torch.cat(outs) if outs else torch.zeros(0, device=device)

        # Backward through a ZeRO-3 module gathers its parameters again, so every rank must
        # also make the same number of *backward* passes: every call (dummy ones included)
        # builds a graph, and dummy outputs join the result with weight zero.
        def score_with_graph(batch: torch.Tensor) -> torch.Tensor:
            return score(batch if batch.requires_grad else batch.detach().requires_grad_(True))

        dummies: list[torch.Tensor] = []
        outs = lockstep_map(score_with_graph, chunks, name=self.name, dummy_results=dummies)
        result = torch.cat(outs) if outs else torch.zeros(0, device=device)
        for d in dummies:
            result = result + 0.0 * d.sum()
        if not outs and torch.is_tensor(images) and images.requires_grad:
            # No sample here: keep the (empty) result in the inputs' graph, so that any loss
            # built from it backpropagates into the upstream model on this rank too. A
            # trainable ZeRO-3 model that gets no backward on one rank skips its gradient
            # reduce there while the others wait in theirs (gloo: "Received data size
            # doesn't match expected size").
            result = result + 0.0 * images.sum()
        return result

    def _score_main_process(self, images, prompts) -> torch.Tensor:
        """Gather samples to rank 0, score there, scatter the scores back in order."""
        local_n = len(images)
        payload = (images.detach().cpu() if torch.is_tensor(images) else images, list(prompts or []))
        gathered = all_gather_object(payload) if is_distributed() else [payload]
        if get_rank() == 0:
            all_images = [g[0] for g in gathered]
            all_images = torch.cat(all_images) if torch.is_tensor(all_images[0]) else sum(all_images, [])
            all_prompts = sum((g[1] for g in gathered), [])
            all_prompts = all_prompts if prompts is not None else None
            scores = self._score_local(all_images, all_prompts, lockstep=False).detach().cpu()
            sizes = [len(g[0]) for g in gathered]
            pieces = list(torch.split(scores, sizes))
        else:
            pieces = None
        if is_distributed():
            out = [None]
            dist.scatter_object_list(out, pieces, src=0)
            mine = out[0]
        else:
            mine = pieces[0]
        assert len(mine) == local_n
        return mine.to(self._scores_device(images))

    # ------------------------------------------------------------------ normalisation

    @staticmethod
    def _global_moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = values.detach().double()
        # CPU: three numbers, moved to the collective's device below and back for the result
        stats = torch.stack(
            [torch.tensor(float(v.numel()), dtype=torch.float64), v.sum().cpu(), (v * v).sum().cpu()]
        )
        if is_distributed():
            stats = stats.to(comm_device())
            dist.all_reduce(stats)
        n, s, ss = stats.cpu().tolist()
        mean = s / max(n, 1.0)
        var = max(ss / max(n, 1.0) - mean * mean, 0.0)
        return torch.tensor(mean), torch.tensor(var**0.5)  # CPU: the caller moves them with .to(rewards)

    def _per_prompt(self, rewards: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        if prompts is None or len(prompts) != len(rewards):
            raise ValueError("normalize='per_prompt' needs one prompt per sample")
        gathered = all_gather_object((list(prompts), rewards.detach().cpu().double().tolist()))
        groups: dict[str, list[float]] = {}
        for ps, rs in gathered:
            for p, r in zip(ps, rs):
                groups.setdefault(p, []).append(r)
        stats = {}
        for p, rs in groups.items():
            t = torch.tensor(rs, dtype=torch.float64)  # CPU: statistics of gathered Python floats
            stats[p] = (t.mean().item(), t.std(correction=0).item())
        mean = torch.tensor([stats[p][0] for p in prompts], dtype=rewards.dtype, device=rewards.device)
        std = torch.tensor([stats[p][1] for p in prompts], dtype=rewards.dtype, device=rewards.device)
        return (rewards - mean) / (std + _EPS)

    # ------------------------------------------------------------------ call

    def __call__(
        self, images, prompts: Sequence[str] | None = None, *, reference_images=None
    ) -> torch.Tensor:
        """This rank's rewards for its ``images`` (and ``prompts``). Collective: every rank."""
        if prompts is not None and len(prompts) != len(images):
            raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
        score = self._score_main_process if self.mode == "main_process" else self._score_local
        rewards = score(images, prompts)
        if self.normalize == "reference":
            if reference_images is None or len(reference_images) != len(images):
                raise ValueError("normalize='reference' needs reference_images, one per image")
            return rewards - score(reference_images, prompts)
        if self.normalize == "batch":
            mean, std = self._global_moments(rewards)
            return (rewards - mean.to(rewards)) / (std.to(rewards) + _EPS)
        if self.normalize == "per_prompt":
            return self._per_prompt(rewards, prompts)
        return rewards

    def lockstep_check(self):
        """Debug check over the reward model's forwards (see ``lockstep_check``)."""
        if self.model is None:
            import contextlib

            return contextlib.nullcontext()
        return self.model.lockstep_check()
