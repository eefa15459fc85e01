"""Shared fixtures (tiny models and data built once per session) and the test tiers.

Tiers (pytest markers): ``unit`` (single process, seconds: ``pytest -m unit`` is the fast
tier), ``multirank`` (2 real ranks through the harness), ``e2e`` (a training script end to
end under ``accelerate launch``), ``gpu`` (CUDA ranks, NCCL; skipped without CUDA:
``pytest -m gpu``). Every test declares exactly one tier: ``pytestmark = pytest.mark.<tier>``
where a whole module is one tier, else a decorator on the test. Collection fails otherwise,
naming the test: a test without a tier would silently drop out of every ``-m`` run.
"""

import inspect

import pytest

TIERS = ("unit", "multirank", "e2e", "gpu")


# tryfirst: before `-m` deselects, so that every collected test is checked whatever the run selects.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Fail collection for a test without exactly one tier marker, and for a tier marker on a
    function that is not a test (a helper), where it does nothing."""
    problems = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: {'tiers ' + ', '.join(tiers) if tiers else 'no tier marker'}")
    for module in {getattr(item, "module", None) for item in items} - {None}:
        for name, obj in vars(module).items():
            if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("test"):
                marked = [m.name for m in getattr(obj, "pytestmark", []) if m.name in TIERS]
                if marked:
                    problems.append(
                        f"{module.__name__}.{name}: a tier marker ({marked[0]}) on a non-test function"
                    )
    if problems:
        raise pytest.UsageError(
            f"each test needs exactly one tier marker ({', '.join(TIERS)}): a module's "
            "`pytestmark = pytest.mark.<tier>` or `@pytest.mark.<tier>` on the test\n  "
            + "\n  ".join(sorted(problems))
        )


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A tiny SD pipeline folder saved by the project itself (fp32 safetensors)."""
    from diffusers_zero3.demo import save_tiny_sd_pipeline

    return str(save_tiny_sd_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-sd"))


@pytest.fixture(scope="session")
def default_data(tmp_path_factory):
    """The embedded default, small: ``(pipeline folder, 16-image dataset, reward model folder)``."""
    from diffusers_zero3.demo import prepare_default

    folder = tmp_path_factory.mktemp("default")
    pipe, data = prepare_default(folder, num_images=16)
    return str(pipe), str(data), str(folder / "redness-reward")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory):
    """A tiny SDXL pipeline and a 10-image dataset of varied sizes: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("sdxl"), num_images=10, model="sdxl")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    """A tiny Flux.1 pipeline (guidance-distilled) and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("flux"), num_images=8, model="flux")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """A tiny SD3 pipeline and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("sd3"), num_images=8, model="sd3")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def preferences(tmp_path_factory):
    """A generated Pick-a-Pic-style preference dataset: 12 pairs and 2 ties (parquet)."""
    from diffusers_zero3.demo import write_preference_dataset

    return str(
        write_preference_dataset(tmp_path_factory.mktemp("prefs") / "preferences", num_pairs=12, ties=2)
    )


@pytest.fixture(scope="session")
def tiny_qwenimage(tmp_path_factory):
    """A tiny Qwen-Image pipeline (Qwen2.5-VL text encoder) and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("qwenimage"), num_images=8, model="qwenimage")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_zimage(tmp_path_factory):
    """A tiny Z-Image pipeline (Qwen3 text encoder) and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("zimage"), num_images=8, model="zimage")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_krea2(tmp_path_factory):
    """A tiny Krea 2 pipeline (Qwen3-VL text encoder) and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("krea2"), num_images=8, model="krea2")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_ideogram4(tmp_path_factory):
    """A tiny Ideogram 4 pipeline (Qwen3-VL text encoder, two transformers) and an 8-image
    dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("ideogram4"), num_images=8, model="ideogram4")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_nucleusmoe(tmp_path_factory):
    """A tiny NucleusMoE-Image pipeline (Qwen3-VL text encoder, MoE transformer) and an 8-image
    dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("nucleusmoe"), num_images=8, model="nucleusmoe")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_kontext(tmp_path_factory):
    """A tiny Flux.1 Kontext pipeline and a folder of 8 editing pairs: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("kontext"), num_images=8, model="kontext")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_qwenimage_edit(tmp_path_factory):
    """A tiny Qwen-Image-Edit-Plus pipeline (Qwen2.5-VL with its vision tower) and a folder of 8
    editing pairs: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(
        tmp_path_factory.mktemp("qwenimage_edit"), num_images=8, model="qwenimage-edit"
    )
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_hidream(tmp_path_factory):
    """A tiny HiDream-I1 pipeline without its Llama encoder (saved beside it, ``<pipeline>-llama``,
    as it is supplied separately) and an 8-image dataset: ``(pipeline, dataset)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("hidream"), num_images=8, model="hidream")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory):
    """A tiny Flux.2 [dev] pipeline (Mistral 3 VLM text encoder) and an 8-image dataset."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("flux2"), num_images=8, model="flux2")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_flux2_klein(tmp_path_factory):
    """A tiny Flux.2 [klein] pipeline (Qwen3 text encoder) and an 8-image dataset."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("flux2-klein"), num_images=8, model="flux2-klein")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """A tiny Wan 2.1 pipeline (umT5, a video VAE) and 16 clips of moving shapes: ``(pipeline, clips)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("wan"), num_images=16, model="wan")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_wan22(tmp_path_factory):
    """A tiny Wan 2.2 A14B-shaped pipeline (two experts) and 16 clips: ``(pipeline, clips)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("wan22"), num_images=16, model="wan22")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_hunyuanvideo15(tmp_path_factory):
    """A tiny HunyuanVideo 1.5 pipeline (Qwen2.5-VL and ByT5 encoders, a video VAE) and 16 clips of
    moving shapes: ``(pipeline, clips)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(
        tmp_path_factory.mktemp("hunyuanvideo15"), num_images=16, model="hunyuanvideo15"
    )
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory):
    """A tiny LTX-2 pipeline (Gemma 3 and connectors, video and audio VAEs, a vocoder) and 16
    clips of moving shapes with a tone each (some without sound): ``(pipeline, clips)``."""
    from diffusers_zero3.demo import prepare_default

    pipe, data = prepare_default(tmp_path_factory.mktemp("ltx2"), num_images=16, model="ltx2")
    return str(pipe), str(data)


@pytest.fixture(scope="session")
def tiny_wan22_5b(tmp_path_factory):
    """A tiny Wan 2.2 TI2V-5B-shaped pipeline (one expert, per-token timesteps): the folder."""
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import WAN22_5B

    return str(save_tiny_pipeline(WAN22_5B, tmp_path_factory.mktemp("wan22-5b") / "tiny-wan22_5b"))
