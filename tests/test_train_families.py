"""scripts/train_text_to_image.py on the families with LLM text encoders, 2 ZeRO-3 ranks each:
the LLM encoder sharded with EMA, checkpoints (an exact resume where it has something of the
family's own: ``RESUMED``), and an output pipeline that
``DiffusionPipeline.from_pretrained`` loads and that generates; then the encoder cached with
LoRA at the family's default targets, loadable with the pipeline's ``load_lora_weights``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_harness import accelerate_launch, launches_of_selected_tests, step_values

pytestmark = pytest.mark.e2e

SCRIPT = "scripts/train_text_to_image.py"

# family: (its LLM encoder folders, the other frozen models' placements, extra flags)
CASES = {
    "qwenimage": (["text_encoder"], [], []),
    "zimage": (["text_encoder"], [], []),
    "flux2": (["text_encoder"], [], ["--guidance_scale", "2.5"]),  # dev is guidance-distilled
    "flux2-klein": (["text_encoder"], [], []),
    "krea2": (["text_encoder"], [], []),
    "ideogram4": (["text_encoder"], [], []),
    # T5; trains on a folder of editing pairs; validation and the output edit an image
    "kontext": (["text_encoder_2"], [], ["--validation_image", "{pipeline}-source.png"]),
    # the system prompt takes about 65 of the tokens: room for the caption
    "nucleusmoe": (["text_encoder"], [], ["--max_sequence_length", "96"]),
    # the Llama (text_encoder_4, with its tokenizer) supplied from its own folder, as in real use
    "hidream": (["text_encoder_3", "text_encoder_4"], [], ["--component", "text_encoder_4={pipeline}-llama"]),
}
# the sharded test's extra flags: Ideogram 4 trains both its transformers there, each its own engine
SHARDED_EXTRA = {"ideogram4": ["--train_denoisers", "both"]}
# The families whose sharded run is also resumed from its checkpoint-2 (steps 3-4 and the final
# weights repeat): those whose resume has something of their own, Ideogram 4's objective and two
# engines, Kontext's editing pairs, HiDream's four encoders and supplied Llama. The others train
# with the base flow-matching objective, whose draws come from each sample's generators
# (tests/test_families.py) and whose resume the Flux, SD3 and SD runs check end to end: their
# resume here cost six launches (about 2 minutes of the suite) and checked nothing new.
RESUMED = {"ideogram4", "kontext", "hidream"}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _common(pipe: str, data: str, steps: int, extra: list[str]) -> list[str]:
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--resolution", "32",
            "--center_crop", "--random_flip", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "3", "--report_to", "none",
            "--max_sequence_length", "16", *(a.format(pipeline=pipe) for a in extra)]  # fmt: skip


def _generate(pipeline, family, **kwargs):
    pipeline = family.prepare_validation_pipeline(pipeline, 32)
    pipeline.set_progress_bar_config(disable=True)
    if family.edits:  # an editing pipeline edits a source image
        from diffusers_zero3.demo import shape_image

        kwargs.setdefault("image", shape_image("red", "circle"))
    return pipeline(
        prompt="a red circle", num_inference_steps=2, height=32, width=32, **family.validation_kwargs(16, None),
        **kwargs,
    ).images  # fmt: skip


def _family(name: str, request):
    from diffusers_zero3.families import family_named

    pipe, data = request.getfixturevalue(f"tiny_{name.replace('-', '_')}")
    return family_named(name), pipe, data


def _sharded_args(name: str, pipe: str, data: str) -> list[str]:
    """The sharded run's flags (without --output_dir and validation): its resume repeats them."""
    llm, others, extra = CASES[name]
    placements = [a for e in llm for a in (f"--{e}_placement", "shard")] + others
    return [*_common(pipe, data, 4, [*extra, *SHARDED_EXTRA.get(name, [])]), "--use_ema",
            "--checkpointing_steps", "2", *placements]  # fmt: skip


def _lora_args(name: str, pipe: str, data: str) -> list[str]:
    llm, others, extra = CASES[name]
    placements = [a for e in llm for a in (f"--{e}_placement", "cache")] + others
    return [*_common(pipe, data, 2, extra), *placements, "--rank", "4", "--validation_prompts", "a blue square",
            "--validation_steps", "2", "--num_validation_inference_steps", "2"]  # fmt: skip


VALIDATION = ["--validation_prompts", "a red circle", "--validation_steps", "4",
              "--num_validation_inference_steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def first_runs(request, tmp_path_factory):
    """Every selected test's first launch (the sharded run, or the cached LoRA run), side by
    side: ``{test name: ((returncode, output), output folder)}``. They are independent (each
    its own folder and port); the resumes wait for them (``resumes``)."""
    folders = {}

    def launch_for(item):
        name = item.callspec.params["name"]
        _, pipe, data = _family(name, request)
        if item.originalname == "test_llm_encoder_sharded_ema_checkpoint_exact_resume_and_output":
            out = folders[item.name] = tmp_path_factory.mktemp(f"{name}-sharded") / "run"
            args = [*_sharded_args(name, pipe, data), *VALIDATION]
        else:
            out = folders[item.name] = tmp_path_factory.mktemp(f"{name}-lora") / "lora"
            args = _lora_args(name, pipe, data)
        return {"argv": [*accelerate_launch(SCRIPT), *args, "--output_dir", str(out)]}

    results = launches_of_selected_tests(request, launch_for)
    return {test: (result, folders[test]) for test, result in results.items()}


@pytest.fixture(scope="module")
def resumes(request, first_runs, tmp_path_factory):
    """Each selected sharded run resumed from its checkpoint-2 in a fresh folder (steps 3-4),
    side by side: ``{test name: ((returncode, output), folder)}``; none where the first run
    left no checkpoint-2 (its test fails on the first run's checks)."""
    import shutil

    folders = {}

    def launch_for(item):
        if item.name not in first_runs or "sharded" not in item.originalname:
            return None
        if item.callspec.params["name"] not in RESUMED:
            return None
        out = first_runs[item.name][1]
        if not (out / "checkpoint-2").is_dir():
            return None
        name = item.callspec.params["name"]
        _, pipe, data = _family(name, request)
        folder = folders[item.name] = tmp_path_factory.mktemp(f"{name}-resumed") / "resumed"
        folder.mkdir()
        shutil.copytree(out / "checkpoint-2", folder / "checkpoint-2")
        return {"argv": [*accelerate_launch(SCRIPT), *_sharded_args(name, pipe, data), "--output_dir", str(folder),
                         "--resume_from_checkpoint", "latest"]}  # fmt: skip

    results = launches_of_selected_tests(request, launch_for)
    return {test: (result, folders[test]) for test, result in results.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_llm_encoder_sharded_ema_checkpoint_exact_resume_and_output(
    name, request, tmp_path, first_runs, resumes
):
    """The launches run side by side with the other selected tests' (``first_runs``,
    ``resumes``); the checks are each test's own."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    family, pipe, data = _family(name, request)
    llm = CASES[name][0]
    trained = family.trained_denoisers("both") if name in SHARDED_EXTRA else (family.denoiser,)
    (code, log), out = first_runs[request.node.name]
    assert code == 0, log[-8000:]
    losses = step_values(log)
    assert sorted(losses) == [1, 2, 3, 4], log[-3000:]
    for encoder in llm:
        assert f"{encoder}: shard" in log
    assert ("editing pairs: 1 source image(s) per target" in log) == family.edits
    assert f"{family.pipeline_class}.from_pretrained" in log
    assert (out / "validation" / "step-000004.png").exists()

    # The output loads and generates; the (EMA) denoiser changed; frozen components are the source's.
    pipeline = DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == family.pipeline_class
    assert _generate(pipeline, family)[0].size == (32, 32)
    if family.edits:  # the model card's snippet edits a source image as printed (validation's 2 steps)
        from diffusers_zero3.demo import shape_image
        from tests.common import run_card_snippet

        (tmp_path / "card").mkdir()
        scope = run_card_snippet(out, tmp_path / "card", source_image=shape_image("red", "circle"))
        assert scope["image"].size == (32, 32) and (tmp_path / "card" / "edited.png").exists()
        from PIL import Image

        grid = Image.open(out / "validation" / "step-000004.png")  # the source above its edit
        assert (
            grid.size == (32, 64)
            and grid.crop((0, 0, 32, 32)).tobytes() == shape_image("red", "circle").tobytes()
        )
    weights = "diffusion_pytorch_model.safetensors"
    after = {}
    for denoiser in trained:  # each trained denoiser changed
        before, after[denoiser] = (
            load_file(str(Path(pipe) / denoiser / weights)),
            load_file(str(out / denoiser / weights)),
        )
        assert before.keys() == after[denoiser].keys()
        assert any(not torch.equal(before[k], after[denoiser][k]) for k in before), denoiser
    untrained = [d for d in family.pipeline_denoisers if d not in trained]  # Ideogram 4's
    for component in (*family.frozen_components, *family.tokenizer_folders, *untrained):
        source = Path(pipe) / component
        if source.is_dir():
            assert _files(out / component) == _files(source), component

    # Resumed from checkpoint-2 in a fresh folder: steps 3-4 and the final EMA weights repeat.
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    if name not in RESUMED:
        return
    (code, log2), resumed = resumes[request.node.name]
    assert code == 0, log2[-8000:]
    again = step_values(log2)
    assert sorted(again) == [3, 4], log2[-3000:]
    for step in again:
        assert again[step] == pytest.approx(losses[step], abs=2e-6), (step, again, losses)
    for denoiser in trained:
        final = load_file(str(resumed / denoiser / weights))
        for k in after[denoiser]:
            torch.testing.assert_close(final[k], after[denoiser][k], rtol=0, atol=1e-6, msg=f"{denoiser} {k}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_llm_encoder_cached_and_lora_adapters_load_in_the_pipeline(name, request, first_runs):
    """The launch runs side by side with the other selected tests' (``first_runs``)."""
    from diffusers import DiffusionPipeline

    from diffusers_zero3.training.lora import load_lora_into

    family, pipe, data = _family(name, request)
    llm = CASES[name][0]
    (code, log), out = first_runs[request.node.name]
    assert code == 0, log[-8000:]
    assert sorted(step_values(log)) == [1, 2], log[-3000:]
    for encoder in llm:
        assert f"{encoder}: shard" in log and "(to encode the cache as shard)" in log
    assert "encoding 8 rows with the frozen models" in log
    assert (out / "validation" / "step-000002.png").exists()  # the cached encoder reloaded for it
    pipeline = DiffusionPipeline.from_pretrained(pipe, **_supplied(family, pipe))
    base = _generate(pipeline, family, output_type="latent", generator=torch.Generator().manual_seed(0))
    load_lora_into(pipeline, family, out)  # load_lora_weights; NucleusMoE-Image's transformer's own
    adapted = _generate(pipeline, family, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(base, adapted)  # the trained adapters reach the denoiser


def _supplied(family, pipe: str) -> dict:
    """Components a family's tiny pipeline folder lacks, loaded from beside it (HiDream's Llama)."""
    if family.name != "hidream":
        return {}
    from transformers import AutoTokenizer, LlamaForCausalLM

    llama = f"{pipe}-llama"
    return {
        "text_encoder_4": LlamaForCausalLM.from_pretrained(llama),
        "tokenizer_4": AutoTokenizer.from_pretrained(llama),
    }
