"""Bad input, table-driven, on both scripts: one ``error:`` line, exit code 2, nothing written.

Each case runs the script's ``main(argv)`` in this process (a plain single process, as
``python scripts/...`` runs it), so the table costs seconds; two cases also run as real
subprocesses to check the exit code and that no traceback is printed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from diffusers_zero3.families import FAMILIES
from tests.distributed_harness import REPO_ROOT, run_launcher

pytestmark = pytest.mark.unit

_SCRIPTS: dict[str, object] = {}


def _script(name: str):
    if name not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"script_{name}", REPO_ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[name] = module
    return _SCRIPTS[name]


def _run_in_process(name: str, argv: list[str], capfd) -> tuple[int, str]:
    from accelerate.state import AcceleratorState, GradientState

    saved_env = dict(os.environ)
    root = logging.getLogger()
    saved_logging = (root.handlers[:], root.level)  # the scripts' basicConfig(force=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        code = _script(name).main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    out, err = capfd.readouterr()
    return code, out + err


@pytest.fixture(scope="module")
def bad_data(default_data, tiny_sdxl, tiny_flux, tmp_path_factory):
    """Datasets (and pipelines) that are wrong in one way each, next to the good default."""
    pipe, data, _ = default_data
    root = tmp_path_factory.mktemp("bad-data")
    unknown = root / "unknown-pipeline"
    shutil.copytree(pipe, unknown)
    index = json.loads((unknown / "model_index.json").read_text())
    (unknown / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyPipeline"}))
    empty = root / "empty"
    empty.mkdir()
    strings = root / "strings"  # an "image" column of paths to no file
    strings.mkdir()
    rows = [{"image": f"img{i}.png", "text": f"caption {i}"} for i in range(8)]
    (strings / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "empty": str(empty),
        "strings": str(strings),
        "unknown": str(unknown),
        "sdxl": tiny_sdxl[0],
        "flux": tiny_flux[0],
    }


def _t2i(pipe, data, out):
    return ["--pretrained_model_name_or_path", pipe, "--train_data_dir", data, "--output_dir", out,
            "--resolution", "32", "--center_crop", "--train_batch_size", "2", "--max_train_steps", "2",
            "--seed", "0", "--report_to", "none"]  # fmt: skip


def _reward(pipe, reward, out):
    return ["--pretrained_model_name_or_path", pipe, "--reward_model_name_or_path", reward,
            "--prompts", "a red circle", "--output_dir", out, "--resolution", "32", "--max_train_steps", "2",
            "--num_inference_steps", "2", "--reward_placement", "replicate", "--report_to", "none"]  # fmt: skip


# (flags to add or replace, message). "{pipe}", "{strings}" and "{empty}" are filled in.
COMMON_CASES = [
    (["--pretrained_model_name_or_path", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
    (["--resolution", "30"], "--resolution must be divisible by 8"),
    (["--checkpointing_steps", "0"], "--checkpointing_steps must be a positive number, got 0"),
    (["--checkpoints_total_limit", "0"], "--checkpoints_total_limit must be a positive number, got 0"),
    (["--checkpoints_total_limit", "-1"], "--checkpoints_total_limit must be a positive number"),
    (["--train_batch_size", "-2"], "--train_batch_size must be a positive number"),
    (["--max_train_steps", "0"], "--max_train_steps must be a positive number"),
    (["--mixed_precision", "fp16"], "--mixed_precision fp16 does not run on CPU"),
    (["--output_dir", "{pipe}"], "is the source pipeline folder"),
    (["--output_dir", "{pipe}/inside"], "is the source pipeline folder"),
    (["--resume_from_checkpoint", "checkpoint-77"], "--resume_from_checkpoint 'checkpoint-77': no complete"),
    (["--process_group_timeout", "0"], "--process_group_timeout must be positive"),
    (["--dead_rank_timeout", "-1"], "--dead_rank_timeout must not be negative (0: off), got -1.0"),
    (["--save_on_signal", "SIGKILL"], "--save_on_signal: SIGKILL is not a signal a process can catch"),
    (["--max_nonfinite_steps", "-1"], "--max_nonfinite_steps must not be negative, got -1"),
    (["--report_to", "nonsense"], "--report_to must be one of tensorboard, wandb, all, none, got 'nonsense'"),
]
T2I_CASES = COMMON_CASES + [
    (["--caption_column", "caption"], "--caption_column value 'caption' is not a dataset column"),
    (["--text_encoder_placement", "shard"], "--text_encoder_placement shard needs DeepSpeed"),
    (["--vae_placement", "offload"], "--vae_placement offload needs DeepSpeed"),
    (  # issue 49, defect 5: the cache held each row's own caption, the emptied ones were ignored
        ["--text_encoder_placement", "cache", "--caption_dropout", "0.1"],
        "--text_encoder_placement cache holds each row's caption embedding, so --proportion_empty_prompts",
    ),
    (["--use_8bit_adam"], "--use_8bit_adam needs bitsandbytes"),
    (["--vae_placement", "sharded"], "argument --vae_placement: invalid choice: 'sharded'"),
    (
        ["--dream_training", "--prediction_type", "v_prediction"],
        "--dream_training supports epsilon prediction only",
    ),
    (["--max_train_samples", "0"], "--max_train_samples must be a positive number, got 0"),
    (["--validation_epochs", "0"], "--validation_epochs must be a positive number, got 0"),
    (["--validation_steps", "-3"], "--validation_steps must be a positive number"),
    (["--lr_warmup_steps", "-1"], "--lr_warmup_steps must not be negative"),
    (
        ["--max_train_samples", "1"],
        "the dataset has 1 rows, fewer than processes x --train_batch_size = 1 x 2",
    ),
    (["--train_data_dir", "{empty}"], "cannot load the dataset"),
    (
        ["--dataset_name", "{strings}"],
        "--image_column 'image' holds image paths, and none of the first 8 exists",
    ),
    (["--train_data_dir", "/nonexistent/data"], "--train_data_dir '/nonexistent/data' is not a directory"),
    (
        ["--use_aspect_ratio_buckets", "--aspect_ratio_buckets", "32,31"],
        "height and width must be multiples of 2",
    ),
    (["--aspect_ratio_buckets", "32,32"], "--aspect_ratio_buckets needs --use_aspect_ratio_buckets"),
    (["--mask_column", "nope"], "--mask_column 'nope' is not a dataset column"),
    (
        ["--caption_dropout", "0.1", "--proportion_empty_prompts", "0.2"],
        "give --caption_dropout or --proportion_empty_prompts",
    ),
    (["--image_interpolation_mode", "cubic"], "argument --image_interpolation_mode: invalid choice: 'cubic'"),
    (
        ["--streaming", "--vae_placement", "cache"],
        "--streaming reads each row once per epoch as it trains; nothing to cache vae",
    ),
    (
        ["--text_encoder_2_placement", "shard"],
        "--text_encoder_2_placement shard: a StableDiffusionPipeline has no",
    ),
    (
        ["--pretrained_model_name_or_path", "{unknown}"],
        "pipeline; supported pipelines: " + ", ".join(sorted(FAMILIES)),
    ),
    (["--component", "text_encoder_2"], "--component takes NAME=PATH, got 'text_encoder_2'"),
    (
        ["--component", "text_encoder_2=/tmp"],
        "--component text_encoder_2=...: a StableDiffusionPipeline has no component text_encoder_2",
    ),
    (["--component", "vae=/nonexistent/vae"], "model folder '/nonexistent/vae' does not exist"),
    (
        ["--component", "vae={pipe}/vae", "--pretrained_vae_model_name_or_path", "{pipe}/vae"],
        "--component vae is given twice",
    ),
    (
        ["--pretrained_model_name_or_path", "{sdxl}", "--dream_training"],
        "--dream_training is not supported for",
    ),
    (["--proportion_empty_prompts", "1.5"], "--proportion_empty_prompts must be between 0 and 1"),
    (
        ["--pretrained_model_name_or_path", "{flux}", "--snr_gamma", "5"],
        "--snr_gamma 5.0 does not apply to a FluxPipeline, which trains with flow matching",
    ),
    (
        ["--weighting_scheme", "cosmap"],
        "--weighting_scheme cosmap does not apply to a StableDiffusionPipeline",
    ),
    (["--weighting_scheme", "uniform"], "argument --weighting_scheme: invalid choice: 'uniform'"),
    (["--max_sequence_length", "0"], "--max_sequence_length must be a positive number, got 0"),
    (
        ["--text_encoder_3_placement", "cache"],
        "--text_encoder_3_placement cache: a StableDiffusionPipeline has no",
    ),
    (
        ["--timestep_bias_strategy", "range", "--timestep_bias_begin", "500", "--timestep_bias_end", "100"],
        "do not make a range",
    ),  # fmt: skip
]
REWARD_CASES = COMMON_CASES + [
    (["--reward_placement", "shard"], "--reward_placement shard needs DeepSpeed"),
    (["--reward_placement", "offload"], "--reward_placement offload needs DeepSpeed"),
    (["--text_encoder_placement", "shard"], "--text_encoder_placement shard needs DeepSpeed"),
    (
        ["--truncated_backprop_steps", "5"],
        "--truncated_backprop_steps must be between 1 and --num_inference_steps",
    ),
    (["--reward_micro_batch_size", "0"], "--reward_micro_batch_size must be a positive number"),
    (
        ["--reward_placement", "everywhere"],
        "--reward_placement everywhere: choose one of replicate, shard, offload",
    ),
    (
        ["--reward", "diffusers_zero3.demo.rewards:redness"],
        "give the rewards with --reward (and --reward_model), or --reward_model_name_or_path",
    ),
    (
        ["--reward_model_class", "diffusers_zero3.demo:save_tiny_sd_pipeline"],
        "a function reward has no model to load",
    ),
    (["--pretrained_model_name_or_path", "{sdxl}"], "is not a StableDiffusionPipeline; this script samples"),
]


DPO_CASES = [
    (
        ["--dataset_name", "{strings}"],
        "the preference dataset lacks the column(s) jpg_0, jpg_1, label_0, caption",
    ),
    (["--vae_placement", "cache"], "--vae_placement cache does not apply to preference pairs"),
    (["--reference_placement", "shard"], "--reference_placement shard applies to --rank 0"),
    (["--rank", "0", "--reference_placement", "shard"], "--reference_placement shard needs DeepSpeed"),
    (["--beta_dpo", "0"], "--beta_dpo must be positive, got 0.0"),
    (["--loss_type", "kto"], "argument --loss_type: invalid choice: 'kto'"),
    (
        ["--pretrained_model_name_or_path", "{flux}"],
        "train_dpo.py trains SD 1.x/2.x and SDXL pipelines, not FluxPipeline",
    ),
    (["--train_data_dir", "{empty}"], "train_dpo.py reads preference pairs from --dataset_name"),
    (["--dataset_split_name", "validation"], "dataset has no 'validation' split"),
    (["--rank", "-2"], "--rank must be a positive number, got -2"),
    (["--max_train_steps", "0"], "--max_train_steps must be a positive number"),
]


def _apply(argv: list[str], change: list[str], fill: dict[str, str]) -> list[str]:
    change = [c.format(**fill) for c in change]
    argv = list(argv)
    i = 0
    while i < len(change):
        flag = change[i]
        values = []
        i += 1
        while i < len(change) and not change[i].startswith("--"):
            values.append(change[i])
            i += 1
        if flag in argv:
            j = argv.index(flag)
            k = j + 1
            while k < len(argv) and not argv[k].startswith("--"):
                k += 1
            argv[j:k] = [flag, *values]
        else:
            argv += [flag, *values]
    return argv


def _check(code: int, log: str, message: str, out: Path, pipe: str, pipe_files: set[str]):
    assert code == 2, log[-3000:]
    assert message in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert not (out / "model_index.json").exists() and not list(out.glob("checkpoint-*"))
    assert {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")} == pipe_files  # source untouched


@pytest.mark.parametrize("change, message", T2I_CASES, ids=[" ".join(c) for c, _ in T2I_CASES])
def test_text_to_image_bad_input(default_data, bad_data, tmp_path, capfd, change, message):
    pipe, data, _ = default_data
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = _apply(_t2i(pipe, data, str(out)), change, {"pipe": pipe, **bad_data})
    code, log = _run_in_process("train_text_to_image", argv, capfd)
    _check(code, log, message, out, pipe, files)


@pytest.mark.parametrize("change, message", REWARD_CASES, ids=[" ".join(c) for c, _ in REWARD_CASES])
def test_reward_bad_input(default_data, bad_data, tmp_path, capfd, change, message):
    pipe, _, reward = default_data
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = _apply(_reward(pipe, reward, str(out)), change, {"pipe": pipe, **bad_data})
    code, log = _run_in_process("train_reward", argv, capfd)
    _check(code, log, message, out, pipe, files)


@pytest.mark.parametrize("change, message", DPO_CASES, ids=[" ".join(c) for c, _ in DPO_CASES])
def test_dpo_bad_input(default_data, bad_data, preferences, tmp_path, capfd, change, message):
    pipe, _, _ = default_data
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", pipe, "--dataset_name", preferences, "--output_dir", str(out),
            "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "2", "--report_to", "none"]  # fmt: skip
    code, log = _run_in_process("train_dpo", _apply(argv, change, {"pipe": pipe, **bad_data}), capfd)
    _check(code, log, message, out, pipe, files)


@pytest.mark.parametrize(
    "script, message",
    [
        ("train_text_to_image", "--text_encoder_placement shard needs DeepSpeed"),
        # the reward script's default placement is shard: plain python used to end in an
        # mpi4py import error
        ("train_reward", "--reward_placement shard needs DeepSpeed"),
    ],
)
def test_real_process_exit_code_and_no_traceback(default_data, tmp_path, script, message):
    pipe, data, reward = default_data
    out = tmp_path / "out"
    if script == "train_text_to_image":
        argv = _apply(_t2i(pipe, data, str(out)), ["--text_encoder_placement", "shard"], {})
    else:
        argv = [a for a in _reward(pipe, reward, str(out))]
        argv[argv.index("--reward_placement") : argv.index("--reward_placement") + 2] = []
    _, log = run_launcher([sys.executable, f"scripts/{script}.py", *argv], timeout=200, expect_rc=2)
    assert message in log and "Traceback" not in log, log[-3000:]
    assert not out.exists() or not (out / "model_index.json").exists()


def test_a_source_pipeline_folder_survives_every_refused_run(default_data, tmp_path, capfd):
    """Positive control for the file-set check above: a real run into a sibling folder writes."""
    pipe, data, _ = default_data
    source = tmp_path / "src"
    shutil.copytree(pipe, source)
    out = tmp_path / "ok"
    code, log = _run_in_process("train_text_to_image", _t2i(str(source), data, str(out)), capfd)
    assert code == 0, log[-3000:]
    assert (out / "model_index.json").exists() and (source / "model_index.json").exists()


DREAMBOOTH_CASES = [
    (["--instance_prompt", ""], "train_dreambooth.py needs --instance_data_dir and --instance_prompt"),
    (["--with_prior_preservation"], "--with_prior_preservation needs --class_data_dir and --class_prompt"),
    (["--train_data_dir", "{pipe}"], "train_dreambooth.py reads --instance_data_dir"),
    (["--validation_prompts", "a"], "train_dreambooth.py takes --validation_prompt"),
    (["--instance_data_dir", "/nonexistent/instances"], "/nonexistent/instances is not a directory"),
    (["--prior_loss_weight", "-1"], "--prior_loss_weight must not be negative"),
    (["--num_class_images", "0"], "--num_class_images must be a positive number, got 0"),
    (
        ["--pretrained_model_name_or_path", "{sd3}", "--train_text_encoder"],
        "trains the text encoders of SD, SDXL and Flux.1 pipelines, not of a StableDiffusion3Pipeline",
    ),
    (
        ["--train_text_encoder", "--text_encoder_placement", "cache"],
        "--text_encoder_placement cache: text_encoder is trained (--train_text_encoder)",
    ),
]


@pytest.mark.parametrize("change, message", DREAMBOOTH_CASES, ids=[" ".join(c) for c, _ in DREAMBOOTH_CASES])
def test_dreambooth_bad_input(default_data, bad_data, tiny_sd3, tmp_path, capfd, change, message):
    pipe, data, _ = default_data
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", pipe, "--instance_data_dir", data, "--instance_prompt", "sks",
            "--output_dir", str(out), "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "2",
            "--report_to", "none"]  # fmt: skip
    fill = {"pipe": pipe, "sd3": tiny_sd3[0], **bad_data}
    code, log = _run_in_process("train_dreambooth", _apply(argv, change, fill), capfd)
    _check(code, log, message, out, pipe, files)


VIDEO_CASES = [
    (["--num_frames", "6"], "--num_frames 6"),
    (["--train_experts", "high"], "--train_experts applies to Wan 2.2's two experts, not to a Wan 2.1"),
    (["--height", "40"], "--height 40"),
    (["--frame_stride", "2", "--fps", "4"], "give --frame_stride or --fps, not both"),
    (
        ["--pretrained_model_name_or_path", "{sd}", "--num_frames", "5"],
        "--num_frames applies to video families",
    ),
    (["--context_parallel_size", "3"], "context parallel size 3 must divide the number of processes (1)"),
    (
        ["--attention_backend", "flash"],
        "--attention_backend flash: Flash Attention backend 'flash' is not usable",
    ),
]


LTX2_CASES = [
    (["--connectors_placement", "cache"], "LTX-2's connectors run on the text encoder's stacked states"),
    (["--audio_vae_placement", "cache"], "--audio_vae_placement cache is not supported for LTX-2"),
    (
        ["--context_parallel_size", "2"],
        "--context_parallel_size with LTX-2: its audio stream is not split yet",
    ),
    (["--height", "48"], "--height 48"),  # the pipeline's sides: multiples of 32
]


@pytest.mark.parametrize("change, message", LTX2_CASES, ids=[" ".join(c) for c, _ in LTX2_CASES])
def test_ltx2_bad_input(tiny_ltx2, tmp_path, capfd, change, message):
    pipe, clips = tiny_ltx2
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", clips, "--output_dir", str(out),
            "--resolution", "32", "--num_frames", "5", "--train_batch_size", "1", "--max_train_steps", "1",
            "--report_to", "none", "--max_sequence_length", "16", *change]  # fmt: skip
    code, log = _run_in_process("train_text_to_image", argv, capfd)
    _check(code, log, message, out, pipe, files)


GRPO_CASES = [
    (["--context_parallel_size", "3"], "context parallel size 3 must divide the number of processes (1)"),
    (["--context_parallel_size", "2", "--context_parallel_mode", "rope"], "argument --context_parallel_mode"),
    (
        ["--attention_backend", "flash"],
        "--attention_backend flash: Flash Attention backend 'flash' is not usable",
    ),
]


@pytest.mark.parametrize("change, message", GRPO_CASES, ids=[" ".join(c) for c, _ in GRPO_CASES])
def test_grpo_bad_input(tiny_flux, tmp_path, capfd, change, message):
    pipe = tiny_flux[0]
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", pipe, "--prompts", "a", "--reward",
            "diffusers_zero3.demo.rewards:redness", "--output_dir", str(out), "--resolution", "32",
            "--report_to", "none", "--rank", "4", *change]  # fmt: skip
    code, log = _run_in_process("train_grpo", argv, capfd)
    _check(code, log, message, out, pipe, files)


@pytest.mark.parametrize("change, message", VIDEO_CASES, ids=[" ".join(c) for c, _ in VIDEO_CASES])
def test_video_bad_input(default_data, tiny_wan, tmp_path, capfd, change, message):
    pipe, clips = tiny_wan
    files = {str(p.relative_to(pipe)) for p in Path(pipe).rglob("*")}
    out = tmp_path / "out"
    argv = ["--pretrained_model_name_or_path", pipe, "--train_data_dir", clips, "--output_dir", str(out),
            "--resolution", "32", "--num_frames", "5", "--train_batch_size", "1", "--max_train_steps", "1",
            "--report_to", "none", "--max_sequence_length", "16"]  # fmt: skip
    argv = _apply(argv, change, {"sd": default_data[0]})
    code, log = _run_in_process("train_text_to_image", argv, capfd)
    _check(code, log, message, out, pipe, files)
