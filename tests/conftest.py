import pytest


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A tiny SD pipeline folder saved by the project itself (fp32 safetensors)."""
    from diffusers_zero3.demo import save_tiny_pipeline

    return str(save_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-sd"))
