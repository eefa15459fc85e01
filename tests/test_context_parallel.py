"""Context parallelism under ZeRO-3 (``runtime.context_parallel``): its one-line refusals, and on
2 real ranks a ZeRO-3 engine whose sequence is split K=2 ways (Ulysses) training one step exactly
as one unsplit model (K=1) does on the same sample, for Wan 2.1, Flux.1 and Qwen-Image (fp32;
in bf16 the split forward against the unsplit one)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_on_ranks

# family: (its tiny denoiser's constructor arguments, latents shape, text length, text width)
MODELS = {
    "wan": (
        "WanTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
             text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        (1, 16, 2, 8, 8), 8, 32,
    ),
    "flux": (
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
             axes_dims_rope=(4, 4, 8)),
        (1, 16, 8, 8), 8, 32,
    ),
    "qwenimage": (
        "QwenImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)),
        (1, 4, 1, 8, 8), 8, 16,
    ),
}  # fmt: skip


def _build(name: str, seed: int = 0) -> torch.nn.Module:
    import diffusers

    cls, kwargs, *_ = MODELS[name]
    torch.manual_seed(seed)
    return getattr(diffusers, cls)(**kwargs)


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The same noisy latents, timestep, conditioning and target on every rank."""
    _, _, shape, text_length, text_width = MODELS[name]
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(shape, generator=gen)
    cond = {"encoder_hidden_states": torch.randn(1, text_length, text_width, generator=gen)}
    if name == "flux":
        cond["pooled_projections"] = torch.randn(1, 32, generator=gen)
    if name == "qwenimage":
        cond["encoder_hidden_states_mask"] = torch.ones(1, text_length, dtype=torch.long)
    target = torch.randn(shape, generator=gen)
    return latents, torch.tensor([600.0]), cond, target


def worker_context_parallel_trains_like_one_model(names: list[str]):
    import deepspeed

    from diffusers_zero3.families import family_named
    from diffusers_zero3.runtime.context_parallel import context_parallel, enable_context_parallel
    from diffusers_zero3.runtime.zero3 import gathered_parameters, zero3_init_disabled
    from tests.common import zero3_config

    deepspeed.init_distributed("gloo")
    cp = context_parallel(2, "ulysses")
    assert (
        cp.data_parallel_size == 1
        and cp.data_parallel_rank == 0
        and cp.group_loss(torch.tensor(1.0)).item() == 2.0
    )
    lr = 1.0
    for name in names:
        family = family_named(name)
        latents, t, cond, target = _inputs(name)
        with zero3_init_disabled():
            reference = _build(name)
            model = _build(name)
        # K = 1: one unsplit model, the sample's whole gradient, one SGD step
        out_ref = family.predict(reference, latents, t, cond)
        loss_ref = (out_ref - target).pow(2).mean()
        loss_ref.backward()
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad for p in reference.parameters()
        ]  # unused: none
        expected = torch.cat([(p - lr * g).detach().flatten() for p, g in zip(reference.parameters(), grads)])
        unscaled = torch.cat(
            [(p - lr * g / 2).detach().flatten() for p, g in zip(reference.parameters(), grads)]
        )

        # K = 2 under ZeRO-3: each rank half the tokens, parameters partitioned over both
        enable_context_parallel(model, cp, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        config = {**zero3_config(), "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        out = family.predict(engine, latents, t, cond)
        torch.testing.assert_close(out, out_ref.detach(), rtol=1e-5, atol=1e-6)
        loss = (out - target).pow(2).mean()
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-6, atol=0)
        engine.backward(cp.group_loss(loss))
        engine.step()
        with gathered_parameters(list(engine.module.parameters())):
            updated = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
        worst = (updated - expected).abs().max().item()
        torch.testing.assert_close(updated, expected, rtol=1e-5, atol=1e-6)
        # the control: without the loss scale ZeRO-3's average over the 2 ranks halves the step
        assert not torch.allclose(expected, unscaled, rtol=1e-5, atol=1e-6)
        engine.destroy()

        # bf16: the split forward against the unsplit one, the same bf16 weights
        with zero3_init_disabled():
            reference, model = _build(name).to(torch.bfloat16), _build(name).to(torch.bfloat16)
        enable_context_parallel(model, cp, torch.device("cpu"))
        bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in cond.items()}
        with torch.no_grad():
            out_ref = family.predict(reference, latents.to(torch.bfloat16), t, bf16)
            out = family.predict(model, latents.to(torch.bfloat16), t, bf16)
        bf16_diff = (out.float() - out_ref.float()).abs().max().item()
        torch.testing.assert_close(out, out_ref, rtol=1.6e-2, atol=1e-2)
        print(
            f"OK cp {name} loss {loss.item():.6f} max weight diff {worst:.2e} bf16 output diff {bf16_diff:.2e}",
            flush=True,
        )


@pytest.mark.multirank
def test_a_sequence_split_two_ways_trains_like_one_model_under_zero3():
    outs = run_on_ranks(worker_context_parallel_trains_like_one_model, names=list(MODELS))
    for name in MODELS:
        assert all(f"OK cp {name}" in o for o in outs), outs[0][-3000:]
    print("".join(line for line in outs[0].splitlines(keepends=True) if line.startswith("OK cp")))


@pytest.mark.unit
def test_a_masked_text_padded_for_the_split_leaves_the_output_as_it_was():
    """Qwen-Image trims its text to the batch's longest caption, so its length can be odd at any
    step: padded to a multiple of K with masked positions, the denoiser's output is the same (the
    control: padded without the mask, it is not). bf16 too."""
    from diffusers_zero3.families import family_named
    from diffusers_zero3.runtime.context_parallel import pad_text_to_multiple

    family = family_named("qwenimage")
    model = _build("qwenimage").eval()
    latents, t, cond, _ = _inputs("qwenimage")
    cond = {k: v[:, :7] for k, v in cond.items()}  # 7 text tokens, the last two masked (padding)
    cond["encoder_hidden_states_mask"][:, 5:] = 0
    padded = pad_text_to_multiple(cond, 4)
    assert (
        padded["encoder_hidden_states"].shape[1] == 8 and padded["encoder_hidden_states_mask"].shape[1] == 8
    )
    assert pad_text_to_multiple(cond, 7)["encoder_hidden_states"] is cond["encoder_hidden_states"]
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        model = model.to(dtype)
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items()}
        with torch.no_grad():
            out = family.predict(model, latents.to(dtype), t, cast)
            out_padded = family.predict(model, latents.to(dtype), t, pad_text_to_multiple(cast, 4))
            unmasked = dict(
                pad_text_to_multiple(cast, 4), encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long)
            )
            out_unmasked = family.predict(model, latents.to(dtype), t, unmasked)
        torch.testing.assert_close(out_padded, out, rtol=tol, atol=tol)
        assert not torch.allclose(out_unmasked.float(), out.float(), rtol=tol, atol=tol)


@pytest.mark.unit
def test_a_token_count_that_k_ranks_cannot_split_is_one_line():
    from diffusers_zero3.runtime.context_parallel import check_token_counts

    check_token_counts({"a 64x64 image": 16, "text": 8}, 2)
    with pytest.raises(ValueError, match=r"a 48x48 image has 9 tokens, not a multiple of 2"):
        check_token_counts({"a 64x64 image": 16, "a 48x48 image": 9}, 2)


@pytest.mark.unit
def test_each_context_parallel_mistake_is_one_line():
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.runtime.context_parallel import check_context_parallel, set_attention_backend

    with torch.device("meta"):
        wan = _build("wan")
        unet = UNet2DConditionModel(block_out_channels=(32, 64), cross_attention_dim=32, layers_per_block=1,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))  # fmt: skip
    cases = [
        ((3, "ulysses", 4, wan), "context parallel size 3 must divide the number of processes (4)"),
        ((2, "tree", 2, wan), "context parallel mode must be one of ulysses, ring, got 'tree'"),
        ((2, "ulysses", 2, unet), "UNet2DConditionModel has no context-parallel plan (_cp_plan)"),
        ((4, "ulysses", 4, wan), "Ulysses context parallelism splits the attention heads: WanTransformer3DModel "
                                 "has 2, not divisible by 4"),
        ((2, "ring", 2, wan), "ring attention needs an attention backend that returns the log-sum-exp"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(ValueError) as info:
            check_context_parallel(*args)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    check_context_parallel(2, "ulysses", 4, wan)  # fine: 2 heads over 2, 2 groups of 2
    check_context_parallel(1, "ulysses", 3, unet)  # K = 1: nothing to split
    # --attention_backend: one that returns the log-sum-exp lets ring through; one that cannot run
    # here (flash-attn is not installed) is one line naming the flag
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry.get_active_backend()[0]
    set_attention_backend(wan, "_native_cudnn")
    check_context_parallel(2, "ring", 2, wan)
    # the model's processors alone: the process's active backend (every other model's) is as it was
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    with pytest.raises(ValueError) as info:
        set_attention_backend(wan, "flash")
    assert str(info.value).startswith("--attention_backend flash: ") and "\n" not in str(info.value)

    # issue 51: backends diffusers does not split (they would take the config and ignore it:
    # each rank attending within its own tokens), sage for a trained model, ring in fp32, ring on
    # a model that reads an attention mask
    from diffusers_zero3.runtime.context_parallel import context_parallel_backends

    assert "native" in context_parallel_backends() and "_native_math" not in context_parallel_backends()
    for backend in ("_native_math", "_native_efficient", "flex", "xformers"):
        for module in wan.modules():
            if hasattr(getattr(module, "processor", None), "_attention_backend"):
                module.processor._attention_backend = backend
        with pytest.raises(
            ValueError, match=f"uses the attention backend '{backend}', which diffusers does not"
        ):
            check_context_parallel(2, "ulysses", 2, wan)
    for module in wan.modules():
        if hasattr(getattr(module, "processor", None), "_attention_backend"):
            module.processor._attention_backend = "sage"
    with pytest.raises(ValueError, match="'sage' has no backward in diffusers"):
        check_context_parallel(2, "ulysses", 2, wan)
    check_context_parallel(2, "ulysses", 2, wan, trained=False)  # a frozen model may use it
    set_attention_backend(wan, "_native_cudnn")
    with pytest.raises(ValueError, match="ring attention on '_native_cudnn' takes bf16 or fp16"):
        check_context_parallel(2, "ring", 2, wan, dtype=torch.float32)
    check_context_parallel(2, "ring", 2, wan, dtype=torch.bfloat16)
    with torch.device("meta"):
        qwen = _build("qwenimage")
    set_attention_backend(qwen, "_native_cudnn")
    with pytest.raises(
        ValueError,
        match="whole attention mask, and QwenImageTransformer2DModel reads encoder_hidden_states_mask",
    ):
        check_context_parallel(2, "ring", 2, qwen, dtype=torch.bfloat16)
    check_context_parallel(2, "ulysses", 2, qwen, dtype=torch.float32)


def _batches(loader) -> list[list[int]]:
    return [b.tolist() if torch.is_tensor(b) else [int(x) for x in b] for b in loader]


@pytest.mark.unit
def test_group_loader_deals_batches_to_groups_not_to_ranks(tmp_path):
    """``group_loader`` for 2 groups (4 ranks at K=2): the ranks of a group build the same batches
    (the shuffle is seeded), the groups' batches are disjoint and together cover the epoch, for a
    shuffled dataset, an aspect-ratio bucket sampler (one bucket per global batch) and a stream
    (read by every rank, each group keeping its rows; accelerate's dispatching from rank 0 would
    give every group rank 0's)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from diffusers_zero3.data.buckets import BucketBatchSampler
    from diffusers_zero3.runtime.context_parallel import group_loader

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rows = list(range(24))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from rows

    buckets = [i % 3 for i in rows]  # 3 buckets of 8 rows
    makers = {
        "shuffled": lambda: torch.utils.data.DataLoader(
            rows,
            batch_size=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),  # CPU: a sampler's
        ),
        "buckets": lambda: torch.utils.data.DataLoader(
            rows, batch_sampler=BucketBatchSampler(buckets, 2, num_processes=2, seed=5)
        ),
        "stream": lambda: torch.utils.data.DataLoader(Stream(), batch_size=2, drop_last=True),
    }
    for name, make in makers.items():
        groups = [_batches(group_loader(make(), acc, 2, g)) for g in (0, 1)]
        assert groups[0] == _batches(group_loader(make(), acc, 2, 0)), name  # the group's other rank
        seen = [x for g in groups for b in g for x in b]
        assert sorted(seen) == rows and set(sum(groups[0], [])).isdisjoint(sum(groups[1], [])), (name, groups)
        if name == "buckets":  # a global batch (both groups' k-th batches) is one bucket
            assert all(len({buckets[x] for x in a + b}) == 1 for a, b in zip(*groups)), groups


@pytest.mark.unit
def test_the_trainers_backward_applies_the_context_parallel_factor_once():
    """The text-to-image trainer's backward (``TrainedParts.backward``, accelerate's backward
    stood in by ``loss.backward()``) under K = 2: the gradient is K times the loss's, so an SGD
    step is K times as long as without context parallelism. The multirank test above multiplies
    the loss itself: removing the trainer's multiply, or applying it twice, passed (AdamW is
    nearly invariant to a constant gradient scale, so the end-to-end runs pass too)."""
    from types import SimpleNamespace

    from diffusers_zero3.families.base import DenoiserSchedule
    from diffusers_zero3.runtime.context_parallel import ContextParallel
    from diffusers_zero3.training.parts import TrainedModel
    from diffusers_zero3.training.steps import TrainedParts

    def sgd_step(cp):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        first = TrainedModel("transformer", model, model, optimizer, None)
        parts = TrainedParts(first, [], DenoiserSchedule(("transformer",)), cp)
        accelerator = SimpleNamespace(backward=lambda loss: loss.backward(), sync_gradients=True)
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(torch.arange(6.0, device="cpu").reshape(2, 3)).pow(2).mean()
        parts.backward(accelerator, loss, step=0)
        optimizer.step()
        return [(p.detach() - b) for p, b in zip(model.parameters(), before)]

    plain = sgd_step(None)
    split = sgd_step(ContextParallel(size=2, mode="ulysses", mesh=None))
    assert all(p.abs().sum() > 0 for p in plain)
    for step, step_k in zip(plain, split):
        torch.testing.assert_close(step_k, 2 * step, rtol=1e-6, atol=0)  # K = 2, applied once
