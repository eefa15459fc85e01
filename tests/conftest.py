"""Shared fixtures (tiny models and data built once per session) and the test tiers.

Tiers (pytest markers): ``unit`` (single process, seconds: ``pytest -m unit`` is the fast
tier), ``multirank`` (2 real ranks through the harness), ``e2e`` (a training script end to
end under ``accelerate launch``), ``gpu`` (CUDA ranks, NCCL; skipped without CUDA:
``pytest -m gpu``). Unmarked tests get their module's tier below.
"""

import pytest

MODULE_TIERS = {
    "test_train_text_to_image": "e2e",
    "test_train_reward": "e2e",
    "test_train_sdxl": "e2e",
    "test_train_flux_sd3": "e2e",
    "test_train_dpo": "e2e",
    "test_examples": "e2e",
    "test_faults_and_machines": "e2e",
    "test_bad_input": "unit",
    "test_gpu": "gpu",
}
TIERS = ("unit", "multirank", "e2e", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS):
            continue
        module = item.module.__name__.rsplit(".", 1)[-1]
        source = getattr(item.function, "__code__", None)
        names = source.co_names if source is not None else ()
        tier = MODULE_TIERS.get(module) or ("multirank" if "run_on_ranks" in names else "unit")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A tiny SD pipeline folder saved by the project itself (fp32 safetensors)."""
    from diffusers_zero3.demo import save_tiny_pipeline

    return str(save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-sd"))


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
