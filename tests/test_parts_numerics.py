"""The numbers of several trained parts in one job, on 2 real ranks.

* ``parts.backward_parts`` / ``backward_through`` under ZeRO-3 (fp32 and bf16): a second engine
  fed by a cut output of the first trains on the gradients of the loss, whatever loss scale the
  first engine's backward applied (a known scale stands in for fp16, which DeepSpeed's CPU
  accelerator does not run, and it changes at a step as a dynamic fp16 scale does), and also
  where its outputs reach the loss on one rank and not on the other (no hang, no error, the
  gradients of an unpartitioned computation); a part with no output in a graph is refused.
* Under DDP fp16 (a torch GradScaler on the CPU standing in for accelerate's GPU one) each part's
  gradients are unscaled once, also the part stepped after another's scaler update.
* Wan 2.2 ``--train_experts both`` (``TextToImageTrainer``, under ZeRO-3 and under plain DDP): a
  step that drew one expert leaves the other's weights, optimizer moments, schedule position and
  EMA bit for bit as they were.
"""

from __future__ import annotations

import pytest
import torch

from diffusers_zero3.testing import DDP_ENV, ZERO3_ENV
from tests.distributed_harness import run_on_ranks

# --------------------------------------------------------------------------- two engines, one loss


class _Encoder(torch.nn.Module):
    """Two outputs through layers of their own from a shared one, as a text encoder's hidden
    states and pooled output; matrices large enough to be partitioned."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.hidden = torch.nn.Linear(32, 32)
        self.pool = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return {"a": self.hidden(h), "b": self.pool(h.mean(0, keepdim=True))}


# Which of the encoder's outputs each rank's loss uses, per step: step 2 is the one where rank 1's
# loss reaches no output at all (its gradients are zero), step 1 the one where it reaches `a` only.
USES = [{0: ("a", "b"), 1: ("a",)}, {0: ("a",), 1: ()}, {0: ("a", "b"), 1: ("a", "b")}]
FIRST_SCALE, SECOND_SCALE, LR = 2.0**10, 2.0**4, 0.1


def _consumer_input(outputs: dict, uses: tuple, dtype) -> torch.Tensor:
    """What the first engine (the consumer of the cut) sees: the sum of the outputs this rank uses
    (a constant where it uses none: the first engine still runs, in lockstep)."""
    if not uses:
        return torch.ones(2, 32, dtype=dtype)
    return sum(outputs[k] for k in uses)


def _reference_step(encoder, consumer, step: int, world: int) -> None:
    """One SGD step of unpartitioned fp32 copies on every rank's data: the gradients are the
    mean over ranks of each rank's loss gradient, as the engines reduce them."""
    params = [*encoder.parameters(), *consumer.parameters()]
    for p in params:
        p.grad = None
    for rank in range(world):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = consumer(_consumer_input(encoder(x), USES[step][rank], torch.float32)).pow(2).mean()
        (loss / world).backward()
    with torch.no_grad():
        for p in params:
            if p.grad is None:  # reached by no rank's loss: a zero gradient, as the engines reduce it
                p.grad = torch.zeros_like(p)
            p -= LR * p.grad


def _two_engines_scaled_and_uneven(mixed_precision: str):
    import copy

    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils import safe_get_full_fp32_param

    from diffusers_zero3 import build_accelerator, get_rank
    from diffusers_zero3.training.parts import (
        backward_parts,
        backward_through,
        cut_outputs,
        loss_scale,
        prepare_extra_part,
        prepare_first_part,
        step_part,
    )
    from tests.common import zero3_config

    bf16 = mixed_precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = {**zero3_config(), "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
    accelerator = build_accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), mixed_precision=mixed_precision
    )
    rank, world = get_rank(), accelerator.num_processes
    torch.manual_seed(0)
    encoder, consumer = (
        _Encoder(),
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)),
    )
    # the engines train from the weights in their precision
    ref_encoder, ref_consumer = (copy.deepcopy(m).to(dtype).float() for m in (encoder, consumer))
    first, _ = prepare_first_part(
        accelerator, "consumer", consumer, torch.optim.SGD(consumer.parameters(), lr=LR)
    )
    second = prepare_extra_part(
        accelerator, "encoder", encoder, torch.optim.SGD(encoder.parameters(), lr=LR),
        torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)]), lambda _: 1.0), first_engine=first.engine,
    )  # fmt: skip
    assert second.own_engine
    # Known loss scales, through DeepSpeed's own scalers (its fp16 ones): the first engine's doubles
    # after every second clean step, as a dynamic fp16 scale grows (here: at step 2's update).
    first.engine.optimizer.loss_scaler = DynamicLossScaler(
        init_scale=FIRST_SCALE, scale_window=1, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False
    )
    second.engine.optimizer.loss_scale = SECOND_SCALE
    assert loss_scale(first.engine) == FIRST_SCALE and loss_scale(second.engine) == SECOND_SCALE
    assert loss_scale(encoder) == 1.0  # a module that is not an engine scales nothing

    partitioned = [p for p in encoder.parameters() if p.ds_tensor.numel() < p.ds_numel]
    assert partitioned, "the test needs partitioned encoder weights"
    failures, scales = [], []
    for step in range(len(USES)):
        # The reference runs through the consumer as the first engine holds it: DeepSpeed (0.19.8)
        # updates a dynamic scale before it unscales that step's gradients, so at a growth step
        # (step 2 here) the first engine applies half its gradients. That is DeepSpeed's own
        # doing; the encoder's gradients must be the loss's, whatever the consumer is.
        with torch.no_grad():
            for p, r in zip(consumer.parameters(), ref_consumer.parameters()):
                r.copy_(safe_get_full_fp32_param(p).reshape(r.shape).to(dtype))  # collective, every rank
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
        cut, kept = cut_outputs(second(x))
        loss = first(_consumer_input(cut, USES[step][rank], dtype)).float().pow(2).mean()
        scales.append(loss_scale(first.engine))
        backward_parts(accelerator, loss, first, [(second, kept, cut)])
        step_part(second, accelerator, True)
        step_part(first, accelerator, True)
        _reference_step(ref_encoder, ref_consumer, step, world)

        tol = 3e-2 if bf16 else 1e-5
        ref_grads = [p.grad for p in ref_encoder.parameters()]
        ref_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in ref_grads])
        ).item()
        norm = second.engine.get_global_grad_norm()
        norm = float(norm.item() if torch.is_tensor(norm) else norm)
        if abs(norm - ref_norm) > tol * ref_norm:
            failures.append(f"step {step + 1}: encoder gradient norm {norm:.6g}, expected {ref_norm:.6g} "
                            f"(ratio {norm / ref_norm:.4g}; first engine's scale {scales[-1]:g})")  # fmt: skip
        # the consumer too at step 1, where no scale changes: the reference is the engines' sum
        checked = [("encoder", encoder, ref_encoder)] + (
            [("consumer", consumer, ref_consumer)] if step == 0 else []
        )
        for name, model, ref in checked:
            for (pname, p), r in zip(model.named_parameters(), ref.parameters()):
                got = safe_get_full_fp32_param(p).reshape(r.shape)  # collective, every rank alike
                err = (got - r).abs().max().item()
                if err > tol * max(r.abs().max().item(), 1e-3):
                    failures.append(
                        f"step {step + 1}: {name}.{pname} differs from the unpartitioned run by {err:.3g}"
                    )
    assert not failures, "\n".join(failures)
    assert scales == [FIRST_SCALE, FIRST_SCALE, 2 * FIRST_SCALE]  # it grew at step 2's update
    # A scaled engine with no scale given for the cut's gradients: refused before any backward
    # (the same on every rank: the scale is the engines' configuration, not the data).
    cut, kept = cut_outputs(second(torch.zeros(2, 8, dtype=dtype)))
    with pytest.raises(ValueError, match="upstream_scale"):
        backward_through(second, kept, cut, True)


@pytest.mark.unit
def test_a_part_with_no_output_in_a_graph_is_refused_and_a_plain_model_scales_nothing():
    from diffusers_zero3.training.parts import TrainedModel, backward_through, cut_outputs, loss_scale

    model = torch.nn.Linear(4, 4)
    part = TrainedModel("encoder", model, model, None, None)
    assert loss_scale(model) == 1.0
    with torch.no_grad():
        cut, kept = cut_outputs({"a": model(torch.ones(1, 4))})
    assert not kept
    with pytest.raises(ValueError, match="encoder: none of its outputs carries a graph"):
        backward_through(part, kept, cut, True)


@pytest.mark.multirank
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"], ids=["fp32", "bf16"])
def test_second_engine_trains_on_unscaled_gradients_also_where_a_rank_reaches_none(mixed_precision):
    run_on_ranks(_two_engines_scaled_and_uneven, mixed_precision=mixed_precision, env=ZERO3_ENV, timeout=240)


def _ddp_fp16_parts_unscaled_once():
    import copy

    from diffusers_zero3 import build_accelerator, get_rank
    from diffusers_zero3.training.parts import (
        backward_parts,
        prepare_extra_part,
        prepare_first_part,
        step_part,
    )

    accelerator = build_accelerator(mixed_precision="fp16")
    # accelerate builds its GradScaler on GPUs only; a torch GradScaler on the CPU stands in for it,
    # given to accelerate where it would have made its own (before the optimizers are wrapped)
    assert accelerator.scaler is None and accelerator.distributed_type.name == "MULTI_CPU"
    accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu", init_scale=FIRST_SCALE), True
    rank, world = get_rank(), accelerator.num_processes
    torch.manual_seed(0)
    encoder, consumer = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32)
    ref_encoder, ref_consumer = copy.deepcopy(encoder), copy.deepcopy(consumer)
    # a clipping norm that clips nothing: the clipping path runs (it unscales) and changes no number
    first, _ = prepare_first_part(accelerator, "consumer", consumer, torch.optim.SGD(consumer.parameters(), lr=LR),
                                  max_grad_norm=1e3)  # fmt: skip
    second = prepare_extra_part(
        accelerator, "encoder", encoder, torch.optim.SGD(encoder.parameters(), lr=LR),
        torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)]), lambda _: 1.0), first_engine=first.engine,
        max_grad_norm=1e3,
    )  # fmt: skip
    assert not second.own_engine  # one backward reaches both: nothing is cut under DDP

    def loss_of(enc, con, r):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(r))
        return con(enc(x)).float().pow(2).mean()

    backward_parts(accelerator, loss_of(second, first, rank), first, [])
    step_part(second, accelerator, True)  # the order of the recipes: the other parts, then the first
    step_part(first, accelerator, True)
    for r in range(world):
        (loss_of(ref_encoder, ref_consumer, r) / world).backward()
    failures = []
    for name, model, ref in (("encoder", encoder, ref_encoder), ("consumer", consumer, ref_consumer)):
        for (pname, p), r in zip(model.named_parameters(), ref.parameters()):
            update, expected = p.detach() - r.detach(), -LR * r.grad
            err = (update - expected).abs().max().item()
            if err > 1e-2 * expected.abs().max().item():  # fp16 autocast
                ratio = (update.norm() / expected.norm()).item()
                failures.append(
                    f"{name}.{pname}: update {ratio:.4g} x the expected one (loss scale {FIRST_SCALE:g})"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
def test_ddp_fp16_each_part_is_unscaled_once():
    """Under DDP fp16 one GradScaler scales the loss for every part; clipping a part unscales
    that part's gradients alone, so that a part stepped after another's scaler update is not
    unscaled twice."""
    run_on_ranks(_ddp_fp16_parts_unscaled_once, env=DDP_ENV, timeout=240)


# --------------------------------------------------------------------------- Wan 2.2, both experts


def _torch_optimizer(part) -> torch.optim.Optimizer:
    """The torch optimizer that holds a part's moments: DeepSpeed's inner one over the fp32
    partitions, or the one accelerate wraps."""
    if hasattr(part.engine, "save_checkpoint"):
        return part.engine.optimizer.optimizer
    return part.optimizer.optimizer


def _part_state(part) -> dict:
    """Everything of a part that an optimizer step, a schedule step or an EMA step may move,
    as this rank holds it (its partitions under ZeRO-3), cloned."""
    from deepspeed.utils import safe_get_local_fp32_param

    zero3 = hasattr(part.engine, "save_checkpoint")
    trained = [p for p in part.module.parameters() if p.requires_grad]
    weights = [p.ds_tensor.clone() for p in trained] if zero3 else [p.detach().clone() for p in trained]
    if zero3:
        weights += [safe_get_local_fp32_param(p).detach().clone() for p in trained]
    optimizer = _torch_optimizer(part)
    # DeepSpeed empties its inner optimizer's param_groups between steps: read the state itself
    moments = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in optimizer.state.values()
    ]
    schedule = getattr(part.lr_scheduler, "scheduler", part.lr_scheduler)
    position = {
        "last_epoch": schedule.last_epoch if schedule is not None else None,  # GRPO: no schedule
        "lr": [g["lr"] for g in optimizer.param_groups],
        "engine_steps": getattr(part.engine, "global_steps", None),
    }
    ema = {"step": part.ema.optimization_step, "shadow": [s.clone() for s in part.ema.shadow]}
    return {"weights": weights, "moments": moments, "position": position, "ema": ema}


def _same(a, b) -> bool:
    """Bit for bit (tensors by ``torch.equal``, nested lists and dicts element by element)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _diff(a, b) -> str:
    """Which entries of two snapshots differ (for the failure message)."""
    if isinstance(a, dict):
        return ", ".join(f"{k}: {_diff(a[k], b.get(k))}" for k in a if not _same(a[k], b.get(k)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return f"{sum(not _same(x, y) for x, y in zip(a, b))} of {len(a)} entries"
    return f"{a!r:.60} -> {b!r:.60}"


def _wan_both_experts_idle_expert_stays(pipe: str, data: str, out: str, mixed_precision: str):
    from diffusers_zero3.recipes.text_to_image import TextToImageTrainer
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    # seed 3: the steps draw low, low, high, low (p_high = 1/8): both experts sit idle at least once,
    # after a step of their own and after one of the other. AdamW's weight decay and a linear
    # schedule move every weight, moment and learning rate that a step touches.
    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--num_frames", "5", "--train_batch_size", "1", "--gradient_accumulation_steps", "2",
            "--max_train_steps", "4", "--learning_rate", "1e-3", "--lr_scheduler", "linear", "--lr_warmup_steps", "0",
            "--adam_weight_decay", "0.1", "--seed", "3", "--report_to", "none", "--max_sequence_length", "16",
            "--use_ema", "--train_experts", "both", "--checkpointing_steps", "100", "--mixed_precision", mixed_precision,
            "--output_dir", out]  # fmt: skip
    trainer = TextToImageTrainer(TextToImageSettings.parse(argv))
    trainer.setup()
    parts = {p.name: p for p in [trainer.denoiser_part, *trainer.extra_parts]}
    assert sorted(parts) == ["transformer", "transformer_2"], parts

    # The state of both experts at each step's first micro-batch, and at the end.
    snapshots: list[tuple[int, str, dict]] = []
    loss = trainer.loss

    def loss_after_snapshot(batch):
        if not snapshots or snapshots[-1][0] != trainer.global_step:
            states = {name: _part_state(part) for name, part in parts.items()}
            snapshots.append((trainer.global_step, trainer.schedule.of_step(trainer.global_step), states))
        return loss(batch)

    trainer.loss = loss_after_snapshot
    trainer.train()
    snapshots.append((trainer.global_step, "", {name: _part_state(part) for name, part in parts.items()}))

    drawn = [expert for _, expert, _ in snapshots[:-1]]
    assert [step for step, _, _ in snapshots] == [0, 1, 2, 3, 4]
    assert set(drawn) == {"transformer", "transformer_2"}, drawn  # both experts idle at least once
    failures = []
    for (step, expert, before), (_, _, after) in zip(snapshots, snapshots[1:]):
        for name in parts:
            for kind in before[name]:
                same = _same(before[name][kind], after[name][kind])
                if same != (name != expert):  # the idle expert stays, the drawn one moves
                    detail = "" if same else f": {_diff(before[name][kind], after[name][kind])}"
                    failures.append(
                        f"step {step + 1} (drew {expert}): {name} {kind} {'stayed' if same else 'moved'}{detail}"
                    )
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "path, mixed_precision",
    [("zero3", "no"), ("zero3", "bf16"), ("ddp", "no")],
    ids=["zero3-fp32", "zero3-bf16", "ddp"],
)
def test_wan22_step_of_one_expert_leaves_the_other_bit_for_bit(tiny_wan22, tmp_path, path, mixed_precision):
    pipe, data = tiny_wan22
    env = ZERO3_ENV if path == "zero3" else DDP_ENV
    run_on_ranks(
        _wan_both_experts_idle_expert_stays,
        pipe=pipe,
        data=data,
        out=str(tmp_path / "out"),
        mixed_precision=mixed_precision,
        env=env,
        timeout=400,
    )


# --------------------------------------------------------------------------- Prodigy under ZeRO-3


def worker_prodigy_zero3_matches_plain(steps: int = 3):
    """One rank: a ZeRO-3 engine stepping Prodigy (``--optimizer prodigy``) over partitions in
    sub-groups of 16 elements trains as plain Prodigy does (one ``step`` per update, so its
    step-size estimate and its counter advance once per update)."""
    import copy
    from types import SimpleNamespace

    from diffusers_zero3 import gathered_parameters
    from diffusers_zero3.training.parts import build_optimizer, prepare_first_part, set_micro_batch_size
    from tests.common import accelerator_with_zero3

    args = SimpleNamespace(optimizer="prodigy", learning_rate=1.0, adam_beta1=0.9, adam_beta2=0.999,
                           adam_weight_decay=0.01, adam_epsilon=1e-8, prodigy_beta3=None, prodigy_decouple=True,
                           prodigy_use_bias_correction=True, prodigy_safeguard_warmup=True)  # fmt: skip
    accelerator = accelerator_with_zero3(zero3_init_flag=False, world_size=1, sub_group_size=16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    ref_optimizer = build_optimizer(reference, args)
    set_micro_batch_size(accelerator, 1)
    part, _ = prepare_first_part(accelerator, "model", model, build_optimizer(model, args))
    inner = part.optimizer.optimizer
    assert len(inner.fp16_groups) == 1, "one sub-group: Prodigy steps once per update"
    data = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    for x in data:
        accelerator.backward(part.engine(x).pow(2).mean())
        part.optimizer.step()
        part.optimizer.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    prodigy = inner.optimizer
    assert prodigy.param_groups[0]["k"] == ref_optimizer.param_groups[0]["k"] == steps
    assert prodigy.param_groups[0]["d"] == pytest.approx(ref_optimizer.param_groups[0]["d"], rel=1e-5)
    with gathered_parameters(list(part.module.parameters())):
        for p, q in zip(part.module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    print("OK prodigy")


@pytest.mark.multirank
def test_prodigy_under_zero3_steps_once_per_update_as_plain_prodigy():
    pytest.importorskip("prodigyopt")
    outs = run_on_ranks(worker_prodigy_zero3_matches_plain, world_size=1, env=ZERO3_ENV)
    assert "OK prodigy" in outs[0]
