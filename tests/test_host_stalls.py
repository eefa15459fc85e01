"""Host-side stalls (issue 51, item 5): per-sample training draws, the loader's workers and
pinned batches, the offloaded EMA's copies.

On a CUDA host a copy from pageable memory blocks the host until the GPU's queue has run; the
fixes stage host data in pinned memory and copy without blocking, and give the loader worker
processes. On this CPU-only build the unit tests check the choices (a pure function of the
device type), that the values (and so every loss a test pins) are unchanged, and the staging
logic with plain buffers; the ``gpu`` tests check on CUDA that nothing blocks and the
averages are the same (skipped without CUDA).
"""

from __future__ import annotations

import time

import pytest
import torch

META = torch.device("meta")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------ per-sample draws


@pytest.mark.unit
def test_host_data_is_staged_in_pinned_memory_for_cuda_only():
    from diffusers_zero3.runtime.host_transfer import host_to_device, pins_host_memory, stack_to_device

    assert pins_host_memory("cuda") and pins_host_memory(torch.device("cuda", 3))
    assert not any(pins_host_memory(d) for d in ("cpu", "meta", torch.device("cpu")))
    rows = [torch.randn(2, 3) for _ in range(4)]
    moved = stack_to_device(rows, META, torch.bfloat16)
    assert moved.device == META and moved.shape == (4, 2, 3) and moved.dtype == torch.bfloat16
    assert host_to_device(rows[0], META, torch.float16).dtype == torch.float16
    # on the CPU exactly what stack(...).to(...) gives: the values every CPU test pins
    assert torch.equal(stack_to_device(rows, "cpu", torch.bfloat16), torch.stack(rows).to(torch.bfloat16))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sample_noise_and_timesteps_keep_the_generators_values(dtype):
    """The draws are still each sample's CPU generator's (what keeps a sample's noise the same
    on any number of processes), moved as before: bit for bit the old formula's values."""
    from diffusers_zero3.families.objectives import sample_generators, sample_noise, sample_timesteps

    latents = torch.zeros(3, 4, 8, 8, dtype=dtype)
    noise = sample_noise(latents, 0.1, sample_generators(7, 1, [5, 0, 9]))
    expected = []
    for g in sample_generators(7, 1, [5, 0, 9]):
        draw = torch.randn(4, 8, 8, generator=g).to(dtype)
        expected.append(draw + 0.1 * torch.randn(4, 1, 1, generator=g).to(dtype))
    assert torch.equal(noise, torch.stack(expected))
    steps = sample_timesteps(3, 1000, "cpu", generators=sample_generators(7, 1, [5, 0, 9]))
    assert steps.tolist() == [
        torch.randint(0, 1000, (), generator=g).item() for g in sample_generators(7, 1, [5, 0, 9])
    ]
    on_meta = sample_noise(
        torch.empty(3, 4, 8, 8, dtype=dtype, device=META), 0.1, sample_generators(7, 1, [5, 0, 9])
    )
    assert on_meta.device == META and on_meta.dtype == dtype


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("samples", [1, 3])
def test_a_latent_sample_is_diffusers_own_sample(dtype, samples):
    """The VAE's latent sample of a batch with one generator per sample: diffusers' values
    (``DiagonalGaussianDistribution.sample``, which draws in the parameters' dtype), drawn
    through the pinned path; a single generator or none falls back to diffusers' own."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from diffusers_zero3.families.objectives import sample_generators, sample_latent_distribution

    parameters = torch.randn(samples, 8, 4, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    dist = DiagonalGaussianDistribution(parameters)
    indices = list(range(10, 10 + samples))
    ours = sample_latent_distribution(dist, sample_generators(1, 2, indices))
    assert ours.dtype == dtype and torch.equal(ours, dist.sample(generator=sample_generators(1, 2, indices)))
    one = torch.Generator().manual_seed(4)
    assert torch.equal(
        sample_latent_distribution(dist, one), dist.sample(generator=torch.Generator().manual_seed(4))
    )


@pytest.mark.unit
def test_flow_matching_tables_reach_the_latents_device():
    """The scheduler's timesteps and sigmas (host tables) go to the latents' device (through
    ``host_to_device``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families.objectives import flow_matching_loss, sample_generators

    seen = {}

    def predict(noisy, timesteps):
        seen["t"] = timesteps
        return noisy

    latents = torch.empty(2, 4, 8, 8, device=META)
    flow_matching_loss(predict, FlowMatchEulerDiscreteScheduler(), latents, torch.empty_like(latents),
                       generators=sample_generators(0, 0, [1, 2]))  # fmt: skip
    assert seen["t"].device == META and seen["t"].shape == (2,)


# ------------------------------------------------------------------ the loader


@pytest.mark.unit
def test_a_cuda_host_gets_workers_and_pinned_batches_by_default():
    """Before: 0 workers and no pinning on every host (diffusers' default). The CPU keeps that;
    --dataloader_num_workers, when given, wins everywhere."""
    from diffusers_zero3.data.loading import MAX_AUTO_WORKERS, LoaderSettings, loader_settings

    assert loader_settings("cuda", None, 2) == LoaderSettings(1, pin_memory=True, chosen=True)
    assert loader_settings("cuda", None, 1).num_workers == 1  # at least one, even on a crowded host
    assert loader_settings("cuda", None, 64).num_workers == MAX_AUTO_WORKERS
    assert loader_settings("cuda", 0, 64) == LoaderSettings(0, pin_memory=True, chosen=False)
    assert loader_settings("cpu", None, 64) == LoaderSettings(0, pin_memory=False, chosen=True)
    assert loader_settings("cpu", 3, 64) == LoaderSettings(3, pin_memory=False, chosen=False)
    line = loader_settings("cuda", None, 9).describe("cuda")
    assert (
        line
        == "data loader: 4 worker processes (chosen for a cuda host), pinned batches, copied without blocking"
    )
    assert "3 decoding threads (--dataloader_num_workers)" in loader_settings("cpu", 3, 1).describe(
        "cpu", True
    )


@pytest.mark.unit
def test_cores_are_shared_among_the_local_processes(monkeypatch):
    import os

    from diffusers_zero3.data.loading import cpus_per_local_process

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpus_per_local_process() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert cpus_per_local_process() == 1


@pytest.mark.unit
def test_the_flag_defaults_to_the_hosts_choice():
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    args = TextToImageSettings.parse(["--pretrained_model_name_or_path", "m"])
    assert args.dataloader_num_workers is None
    assert TextToImageSettings.parse(["--pretrained_model_name_or_path", "m", "--dataloader_num_workers", "0"]
                                     ).dataloader_num_workers == 0  # fmt: skip


@pytest.mark.unit
def test_a_streamed_loader_pins_when_asked():
    from diffusers_zero3.data.streaming import streamed_loader

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    rows = Rows()
    assert streamed_loader(rows, lambda items: items, 2, pin_memory=True).pin_memory
    assert not streamed_loader(rows, lambda items: items, 2).pin_memory


# ------------------------------------------------------------------ the offloaded EMA


@pytest.mark.unit
def test_an_offloaded_average_of_cuda_weights_is_staged():
    from diffusers_zero3.state.ema import stages_through_pinned_memory, staging_buckets

    assert stages_through_pinned_memory("cpu", "cuda:1")
    assert not stages_through_pinned_memory("cpu", "cpu")  # a CPU host, or DeepSpeed's offloaded optimizer
    assert not stages_through_pinned_memory("cuda:0", "cuda:0")  # no offload: averaged where it lives
    assert staging_buckets([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert staging_buckets([], 8) == []


@pytest.mark.unit
@pytest.mark.parametrize("limit", [1, 40, 10_000])
def test_staged_averages_equal_the_direct_update(limit):
    """Two buffers in turn, buckets of at most ``limit`` elements (one tensor per bucket, some,
    all): bit for bit ``_foreach_lerp_`` of the sources moved to the host as fp32."""
    from diffusers_zero3.state.ema import lerp_through_staging, staging_buckets

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (4, 4, 2), (1,), (30,)]
    shadow = [torch.randn(s, generator=g) for s in shapes]
    sources = [torch.randn(s, generator=g) for s in shapes]
    sources[2] = sources[2].to(torch.bfloat16)  # cast into the fp32 buffer on the way
    expected = [s.clone() for s in shadow]
    torch._foreach_lerp_(expected, [s.float() for s in sources], 0.1)
    buckets = staging_buckets([s.numel() for s in sources], limit)
    size = max(sum(sources[i].numel() for i in b) for b in buckets)
    lerp_through_staging(shadow, sources, 0.1, buckets, (torch.empty(size), torch.empty(size)))
    assert all(torch.equal(a, b) for a, b in zip(shadow, expected))


# ------------------------------------------------------------------ on CUDA (skipped without it)


def _behind_a_long_kernel(fn):
    """``(seconds the host spent in fn, result)`` while a ~0.2 s kernel is queued before it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * torch.cuda.get_device_properties(0).clock_rate * 1000))
    start = time.perf_counter()
    out = fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return spent, out


@pytest.mark.gpu
@CUDA
def test_per_sample_draws_do_not_wait_for_the_gpu():
    """Before: the pageable copy waited for the queued kernel (0.2 s); now it is queued."""
    from diffusers_zero3.families.objectives import sample_generators, sample_noise

    latents = torch.zeros(4, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    spent, noise = _behind_a_long_kernel(
        lambda: sample_noise(latents, 0.1, sample_generators(0, 0, range(4)))
    )
    assert spent < 0.1, f"the draw waited {spent:.3f} s for the GPU"
    on_cpu = sample_noise(latents.cpu(), 0.1, sample_generators(0, 0, range(4)))
    assert torch.equal(noise.cpu(), on_cpu)  # the same values as on the CPU


@pytest.mark.gpu
@CUDA
def test_offloaded_ema_is_pinned_and_averages_as_before():
    from diffusers_zero3.state.ema import ShardedEMA

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    ema = ShardedEMA(model, device="cpu")
    reference = [p.detach().cpu().clone() for p in model.parameters()]
    assert all(s.is_pinned() for s in ema.shadow)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(0.9)
    torch._foreach_lerp_(reference, [p.detach().cpu() for p in model.parameters()], 0.1)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, reference))


@pytest.mark.gpu
@CUDA
def test_a_cuda_loader_yields_pinned_batches():
    from diffusers_zero3.data.loading import loader_settings

    settings = loader_settings("cuda", None, 2)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
        num_workers=settings.num_workers, pin_memory=settings.pin_memory,
    )  # fmt: skip
    assert all(batch[0].is_pinned() for batch in loader)
