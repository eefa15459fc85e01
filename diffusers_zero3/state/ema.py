"""An exponential moving average of a ZeRO-3 model: 1/N of the memory and no communication.

diffusers' ``EMAModel`` under ZeRO-3 keeps a full fp32 shadow on every rank (4Ψ bytes) and
all-gathers the model a tensor at a time (or all at once with ``foreach=True``) every step.
``ShardedEMA`` averages each rank's own fp32 master partition (DeepSpeed's
``safe_get_local_fp32_param``), so ``step()`` touches only local memory: 4Ψ/N bytes per
rank and not a single collective. The decay schedule is ``EMAModel.get_decay``'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..runtime.deepspeed_internals.reads import held_whole, local_fp32_master
from ..runtime.distributed import comm_device, get_rank, get_world_size
from ..runtime.host_transfer import pins_host_memory
from ..runtime.zero3 import is_zero3_param

# Bytes of each of the two pinned staging buffers of an offloaded EMA's update (--offload_ema on
# a CUDA host): bounded, whatever the model's size; a partition larger than this gets a buffer
# of its size.
STAGING_BYTES = 64 * 2**20


def stages_through_pinned_memory(
    shadow_device: torch.device | str, source_device: torch.device | str
) -> bool:
    """Whether an average on ``shadow_device`` is updated from weights on ``source_device``
    through pinned staging buffers (``lerp_through_staging``): host averages of CUDA weights
    (``--offload_ema`` on a GPU host). A copy from CUDA into pageable memory blocks the host
    until it is done, one parameter after the other; into pinned memory it is queued.

    Example:
        >>> stages_through_pinned_memory("cpu", "cuda:0"), stages_through_pinned_memory("cpu", "cpu")
        (True, False)
    """
    return torch.device(shadow_device).type == "cpu" and pins_host_memory(source_device)


def staging_buckets(numels: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of ``numels`` in groups of at most ``limit`` elements (one element
    larger than ``limit`` is a group of its own): the tensors staged together.

    Example:
        >>> staging_buckets([3, 3, 5, 9, 1], 6)
        [[0, 1], [2], [3], [4]]
    """
    buckets: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(numels):
        if total + n > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += n
    return buckets


def lerp_through_staging(
    shadow: list[torch.Tensor],
    sources: list[torch.Tensor],
    weight: float,
    buckets: list[list[int]],
    buffers: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """``shadow[i].lerp_(sources[i], weight)`` for host ``shadow`` and device ``sources``, the
    sources copied bucket by bucket (``staging_buckets``) into two flat fp32 ``buffers`` in
    turn (pinned, on CUDA): bucket k+1's copies are queued before the host averages bucket k,
    so the copies run while the host computes, and the host waits once per bucket (for its
    copies), not once per tensor. The values are those of ``torch._foreach_lerp_(shadow,
    [s.to(shadow's device, float32) for s in sources], weight)``. Not a collective.

    Each buffer holds the largest bucket. A buffer is refilled only after the host has
    averaged what it held (two buckets earlier, synchronously).
    """
    pending = None
    for k, bucket in enumerate(buckets):
        buffer, offset, views = buffers[k % 2], 0, []
        for i in bucket:
            n = sources[i].numel()
            view = buffer[offset : offset + n].view(sources[i].shape)
            view.copy_(sources[i], non_blocking=True)  # a plain copy unless buffer is pinned
            views.append(view)
            offset += n
        ready, cuda = (
            None,
            next((sources[i].device for i in bucket if sources[i].device.type == "cuda"), None),
        )
        if cuda is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda))
        if pending is not None:
            _lerp_when_copied(shadow, weight, *pending)
        pending = (ready, bucket, views)
    if pending is not None:
        _lerp_when_copied(shadow, weight, *pending)


def _lerp_when_copied(shadow, weight: float, ready, bucket: list[int], views: list[torch.Tensor]) -> None:
    if ready is not None:
        ready.synchronize()  # this bucket's copies (and nothing queued after them) are done
    torch._foreach_lerp_([shadow[i] for i in bucket], views, weight)


class ShardedEMA:
    """EMA of a model's trainable parameters, partitioned like the model under ZeRO-3.

    Args:
        model: a DeepSpeed ZeRO-3 engine (or the module it wraps, after ``prepare``), or a
            plain module (then the average is whole, as ``EMAModel``'s).
        decay, min_decay, update_after_step, use_ema_warmup, inv_gamma, power: as
            diffusers' ``EMAModel``; ``get_decay`` gives the same values.
        device: where the averages live (``"cpu"`` for ``--offload_ema``); default: with
            the weights they average.

    Under ZeRO-3 create it after the engine (the optimizer owns the fp32 master partitions
    it averages). ``step()`` is local; ``copy_to``, ``store``/``restore`` of parameters kept
    whole by the persistence threshold, and ``save_pretrained`` are collectives.

    Example:
        >>> unet, optimizer = accelerator.prepare(unet, optimizer)
        >>> ema = ShardedEMA(unet, decay=0.9999)
        >>> for batch in loader:
        ...     ...; optimizer.step()
        ...     if accelerator.sync_gradients:
        ...         ema.step()
        >>> ema.save_pretrained("out/unet")   # every rank
    """

    def __init__(
        self,
        model,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float | int = 1.0,
        power: float | int = 2 / 3,
        device: torch.device | str | None = None,
    ):
        self.module: torch.nn.Module = getattr(model, "module", model)
        self.decay, self.min_decay = decay, min_decay
        self.update_after_step, self.use_ema_warmup = update_after_step, use_ema_warmup
        self.inv_gamma, self.power = inv_gamma, power
        self.optimization_step = 0
        self.cur_decay_value: float | None = None
        self._named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.device = torch.device(device) if device is not None else None
        self.shadow: list[torch.Tensor] = [self._initial_average(self._source(p)) for _, p in self._named]
        self._stored: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        # --offload_ema on a GPU host: update() stages the weights through two pinned buffers
        self._staging: tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _initial_average(self, source: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``source`` where the average lives; in pinned memory for host
        averages of CUDA weights (``stages_through_pinned_memory``: their copies to and from
        the device are then asynchronous, as DeepSpeed pins its offloaded optimizer states)."""
        device = self.device or source.device
        if not stages_through_pinned_memory(device, source.device):
            return source.detach().to(device, torch.float32, copy=True)
        # CPU: the offloaded average lives in pinned host memory
        return torch.empty(source.shape, dtype=torch.float32, pin_memory=True).copy_(source.detach())

    # ---------------------------------------------------------------- averaging

    def _source(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor this rank averages for ``p``: its fp32 master partition under ZeRO-3."""
        if not is_zero3_param(p):
            return p
        master = local_fp32_master(p)
        return master if master is not None else p.ds_tensor

    def get_decay(self, optimization_step: int) -> float:
        """The decay factor after ``optimization_step`` steps (``EMAModel.get_decay``)."""
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            cur = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            cur = (1 + step) / (10 + step)
        return max(min(cur, self.decay), self.min_decay)

    @torch.no_grad()
    def step(self, model=None) -> None:
        """One EMA update from the current weights, with ``get_decay``'s decay. Local: no
        collective, call on every rank."""
        self.optimization_step += 1
        self.update(self.get_decay(self.optimization_step))

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``average = decay * average + (1 - decay) * weights``, with a decay the caller
        schedules (the step counter is left alone: e.g. the RL references' EMA, or DiffusionNFT's
        old policy following the trained one once a round). Local: no collective, call on every
        rank."""
        self.cur_decay_value = decay
        sources = [self._source(p) for _, p in self._named]
        if self.device is not None and any(
            stages_through_pinned_memory(self.device, s.device) for s in sources
        ):
            # --offload_ema on a GPU host: pinned staging, the copies overlapping the averaging
            lerp_through_staging(self.shadow, sources, 1 - decay, *self._staging_buffers(sources))
            return
        sources = [s.to(self.device or s.device, torch.float32) for s in sources]
        # shadow += (1 - decay) * (source - shadow), in place and fused: no temporaries.
        torch._foreach_lerp_(self.shadow, sources, 1 - decay)

    def _staging_buffers(
        self, sources: list[torch.Tensor]
    ) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor]]:
        """The buckets and the two pinned fp32 buffers of ``lerp_through_staging``, made at the
        first update (2 x ``STAGING_BYTES``, or 2 x the largest partition if larger)."""
        if self._staging is None:
            numels = [s.numel() for s in sources]
            buckets = staging_buckets(numels, STAGING_BYTES // 4)
            size = max(sum(numels[i] for i in bucket) for bucket in buckets)
            # CPU: pinned host staging buffers of the offloaded average's update
            buffers = tuple(torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2))
            self._staging = (buckets, buffers)
        return self._staging

    # ---------------------------------------------------------------- live weights

    def _full_of_partition(self, partition: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        """All-gather a flat partition into ``p``'s full shape. Collective."""
        flat = partition.reshape(-1).to(comm_device())
        if get_world_size() > 1:
            parts = [torch.empty_like(flat) for _ in range(get_world_size())]
            dist.all_gather(parts, flat)
            flat = torch.cat(parts)
        return flat[: p.ds_numel].view(p.ds_shape)

    @staticmethod
    def _is_whole(p: torch.nn.Parameter) -> bool:
        # A ZeRO-3 parameter kept whole on every rank (persistence threshold).
        return held_whole(p)

    @torch.no_grad()
    def copy_to(self, model=None) -> None:
        """Write the averages into the live model, partition by partition.

        Collective when some ZeRO-3 parameters are kept whole (persistence threshold): call
        on every rank. Use ``store`` first and ``restore`` after to get the training
        weights back.
        """
        for shadow, (_, p) in zip(self.shadow, self._named):
            if is_zero3_param(p):
                p.ds_tensor.data.copy_(shadow.view_as(p.ds_tensor))
                if self._is_whole(p):
                    p.data.copy_(self._full_of_partition(shadow.to(p.ds_tensor.device), p).to(p.dtype))
            else:
                p.data.copy_(shadow.view_as(p))

    @torch.no_grad()
    def store(self, model=None) -> None:
        """Keep a copy of the live (training) weights of this rank, for ``restore``. Local."""
        stored = []
        for _, p in self._named:
            if is_zero3_param(p):
                whole = p.data.clone() if self._is_whole(p) else None
                stored.append((p.ds_tensor.data.clone(), whole))
            else:
                stored.append((p.data.clone(), None))
        self._stored = stored

    @torch.no_grad()
    def restore(self, model=None) -> None:
        """Put back the weights saved by ``store``, exactly. Local."""
        if self._stored is None:
            raise RuntimeError("ShardedEMA.restore() called without a store() before it")
        for (part, whole), (_, p) in zip(self._stored, self._named):
            if is_zero3_param(p):
                p.ds_tensor.data.copy_(part)
                if whole is not None:
                    p.data.copy_(whole)
            else:
                p.data.copy_(part)
        self._stored = None

    @contextlib.contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Run the block (e.g. validation) with the averaged weights swapped in. Collective."""
        self.store()
        self.copy_to()
        try:
            yield
        finally:
            self.restore()

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """This rank's partition of the averages and the step counter (save one per rank), its
        tensors copied to the host one at a time (no clone of the whole partition on the device
        at a checkpoint, when memory is tightest)."""
        return {
            "optimization_step": self.optimization_step,
            "decay": self.decay,
            "min_decay": self.min_decay,
            "world_size": get_world_size(),
            "names": [n for n, _ in self._named],
            "shadow": [s.detach().to("cpu", copy=True) for s in self.shadow],
        }

    def load_state_dict(self, state: dict) -> None:
        """Load what ``state_dict`` returned on this rank (same model, same world size)."""
        names = [n for n, _ in self._named]
        if state["names"] != names:
            raise ValueError("EMA state was saved for a different set of trainable parameters")
        if state["world_size"] != get_world_size() and any(is_zero3_param(p) for _, p in self._named):
            raise ValueError(
                f"EMA state holds partitions of {state['world_size']} ranks; this run has {get_world_size()}"
            )
        for shadow, saved in zip(self.shadow, state["shadow"]):
            if shadow.shape != saved.shape:
                raise ValueError("EMA state partition shapes do not match this model")
            shadow.copy_(saved)
        self.optimization_step = int(state["optimization_step"])
        self.decay, self.min_decay = state["decay"], state["min_decay"]

    def load_resharded(self, states: list[dict]) -> None:
        """Load the ``state_dict`` of every rank of a run with another number of processes
        (``states[r]`` from its rank ``r``): each average is put back together from the saved
        partitions and this rank's partition of it cut out, as ZeRO-3 partitions it here
        (``ceil(numel / world)`` elements per rank, the last one padded). Not a collective."""
        names = [n for n, _ in self._named]
        if any(state["names"] != names for state in states):
            raise ValueError("EMA state was saved for a different set of trainable parameters")
        rank, world = get_rank(), get_world_size()
        for i, (_, p) in enumerate(self._named):
            if not is_zero3_param(p):  # a plain module's average is whole on every rank
                self.shadow[i].copy_(states[0]["shadow"][i])
                continue
            full = torch.cat([state["shadow"][i].reshape(-1) for state in states])
            numel = p.ds_numel
            size = -(-numel // world)
            mine = torch.zeros(size, dtype=full.dtype)  # CPU: copied into the shadow's device below
            piece = full[:numel][rank * size : (rank + 1) * size]
            mine[: piece.numel()] = piece
            if self.shadow[i].numel() != size:
                raise ValueError(
                    f"EMA partition of {names[i]} holds {self.shadow[i].numel()} elements, not {size}"
                )
            self.shadow[i].copy_(mine.view_as(self.shadow[i]))
        self.optimization_step = int(states[0]["optimization_step"])
        self.decay, self.min_decay = states[0]["decay"], states[0]["min_decay"]

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Write the averaged model as a diffusers model folder. Collective: every rank.

        Streams partitions through ``save_pretrained_zero3`` (config + safetensors, loads
        with the class's ``from_pretrained``); no rank builds the whole model. Parameters
        that are not trained are written as they are in the live model.
        """
        from .pretrained import save_pretrained_zero3

        by_param = {id(p): s for s, (_, p) in zip(self.shadow, self._named)}

        def partition(p: torch.nn.Parameter) -> torch.Tensor | None:
            shadow = by_param.get(id(p))
            return shadow.view_as(p) if shadow is not None and not is_zero3_param(p) else shadow

        save_pretrained_zero3(self.module, save_directory, partitions=partition, **kwargs)

    def local_bytes(self) -> int:
        """Bytes of averages this rank holds."""
        return sum(s.numel() * s.element_size() for s in self.shadow)
