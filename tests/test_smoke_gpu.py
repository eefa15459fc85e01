"""`make smoke-gpu` (scripts/smoke_gpu.py) on a host without a GPU: its case list covers every
model family of the registry and the other scripts and modes; every launch of every case is
built, and the launcher's and the training script's own parsers accept its flags (parsing
only: nothing trains here); the resume on another number of processes picks counts that the
package's own resume check accepts, and says "skipped: needs 2 GPUs" on a host of one; the
real-size case's UNet is SD 1.5's and its DDP config is a plain accelerate config; the table
reads the trainer's memory report; without CUDA the script refuses with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed_harness import REPO_ROOT

pytestmark = pytest.mark.unit


def _script(name: str):
    """``scripts/<name>.py`` as a module (its ``main`` is not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"scripts_{name}"] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke():
    return _script("smoke_gpu")


def _parsers() -> dict:
    """Each script's own parser (with its own checks), by the case's script key."""
    from diffusers_zero3.recipes.controlnet import ControlNetSettings
    from diffusers_zero3.recipes.dpo import DPOSettings
    from diffusers_zero3.recipes.dreambooth import DreamBoothSettings
    from diffusers_zero3.recipes.grpo import GRPOSettings
    from diffusers_zero3.recipes.reward import RewardSettings
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    return {
        "t2i": TextToImageSettings.parse,
        "reward": RewardSettings.parse,
        "dpo": DPOSettings.parse,
        "dreambooth": DreamBoothSettings.parse,
        "controlnet": ControlNetSettings.parse,
        "grpo": GRPOSettings.parse,
    }


def test_every_family_has_a_case(smoke):
    """One text-to-image case per family of the registry: a family added to
    ``diffusers_zero3.families`` without a smoke case fails here, by name."""
    from diffusers_zero3.families import ALL_FAMILIES

    covered = {c.model for c in smoke.CASES if c.script == "t2i"}
    missing = [f.name for f in ALL_FAMILIES if f.name not in covered]
    assert not missing, f"scripts/smoke_gpu.py has no case for the families {', '.join(missing)}"
    assert covered <= {f.name for f in ALL_FAMILIES}


def test_every_script_and_mode_has_a_case(smoke):
    """Besides the families: every script, DreamBooth with the text encoder trained, ControlNet
    beside a sharded UNet, a resume on the same and on another number of processes, and the
    real-size case against DDP."""
    assert {c.script for c in smoke.CASES} == set(smoke.SCRIPTS)
    assert {c.mode for c in smoke.CASES} == set(smoke.MODES)
    flags = {c.script: c.flags.split() for c in smoke.CASES}
    assert "--train_text_encoder" in flags["dreambooth"]
    controlnet = flags["controlnet"]
    assert controlnet[controlnet.index("--unet_placement") + 1] == "shard"
    assert len({c.name for c in smoke.CASES}) == len(smoke.CASES)


def _first_argv(smoke, case, data: Path) -> list[str]:
    """The script's flags of ``case``'s first launch on a host of 2 GPUs, with ``data`` the data
    folder (its ControlNet validation mask made: train_controlnet.py checks the file)."""
    mask = data / "controlnet-shapes-masks" / "circle.png"
    mask.parent.mkdir(parents=True, exist_ok=True)
    mask.touch()
    return list(smoke.plan_launches(case, data, data / "run", 2, 2)[0].argv[1:])


def _exercised(smoke, case, data: Path) -> tuple[set[str], set[str]]:
    """The RL objective and the placements ``case`` runs, read from its parsed flags: every
    ``--*_placement`` its argv gives (a frozen model, the GRPO reference) and each
    ``--reward_placement NAME=VALUE``."""
    argv = _first_argv(smoke, case, data)
    args = _parsers()[case.script](argv)
    placements = {
        getattr(args, name)
        for name in vars(args)
        if name.endswith("_placement") and f"--{name}" in argv and isinstance(getattr(args, name), str)
    }
    placements |= {value.rpartition("=")[2] for value in getattr(args, "reward_placement", [])}
    return ({args.objective} if case.script == "grpo" else set()), placements


def test_every_objective_and_placement_has_a_case(smoke, tmp_path):
    """Each RL objective of scripts/train_grpo.py (``recipes.grpo.OBJECTIVES``) and each placement
    of a frozen model (``args.PLACEMENT_CHOICES``) is run by a case: one added without a smoke
    case fails here, by name (a family without one: ``test_every_family_has_a_case``). Controls:
    the matrix without the cases that run one of them reports exactly that one missing."""
    from diffusers_zero3.args import PLACEMENT_CHOICES
    from diffusers_zero3.recipes.grpo import OBJECTIVES

    exercised = {case.name: _exercised(smoke, case, tmp_path) for case in smoke.CASES}

    def missing(names) -> tuple[list[str], list[str]]:
        objectives = set().union(*(exercised[n][0] for n in names))
        placements = set().union(*(exercised[n][1] for n in names))
        unrun = [p for p in PLACEMENT_CHOICES if p not in placements]
        return [o for o in OBJECTIVES if o not in objectives], unrun

    objectives, placements = missing(exercised)
    assert not objectives, f"scripts/smoke_gpu.py has no case for the RL objectives {', '.join(objectives)}"
    assert not placements, f"scripts/smoke_gpu.py has no case for the placements {', '.join(placements)}"
    assert set(OBJECTIVES) == {"grpo", "nft"}
    assert set(PLACEMENT_CHOICES) == {"replicate", "shard", "offload", "cache"}
    for index, item in enumerate((*OBJECTIVES, *PLACEMENT_CHOICES)):
        kind = 0 if index < len(OBJECTIVES) else 1
        rest = [n for n in exercised if item not in exercised[n][kind]]
        assert missing(rest)[kind] == [item], item
    # the RL cases: a python-function reward beside a built-in reward model sharded; LoRA with nft
    grpo = [c for c in smoke.CASES if c.script == "grpo"]
    rewards = {r for c in grpo for r in _parsers()["grpo"](_first_argv(smoke, c, tmp_path)).reward}
    assert {smoke.REDNESS, "clip_score=0.01"} <= rewards
    assert any("clip_score=shard" in _first_argv(smoke, c, tmp_path) for c in grpo)
    assert any({"nft", "--rank"} <= set(_first_argv(smoke, c, tmp_path)) for c in grpo)


def test_context_parallel_cases_skip_on_one_gpu_and_take_two_processes_on_two(smoke, tmp_path, monkeypatch):
    """Wan with K=2, ring and Ulysses (the text-to-image trainer's, and GRPO's on clips), bf16: on
    a host of one GPU each case is skipped, saying
    why, and launches nothing; on two (``NUM_PROCESSES=1`` too) it launches 2 processes, on 8 four
    groups of 2, and its table row says 2 processes over NCCL. Its flags pass the package's own
    check (``check_context_parallel``) on the tiny Wan's transformer with the case's backend in
    bf16; the control: in fp32 the ring case is refused."""
    from accelerate.commands.config.config_args import load_config_from_file

    from diffusers_zero3.demo.pipelines import tiny_wan_components
    from diffusers_zero3.families import WAN
    from diffusers_zero3.runtime.context_parallel import (
        check_context_parallel,
        context_parallel_backends,
        set_attention_backend,
    )

    cases = [c for c in smoke.CASES if smoke.context_parallel_size(c) > 1]
    args = {c.name: _parsers()[c.script](_first_argv(smoke, c, tmp_path)) for c in cases}
    assert sorted(a.context_parallel_mode for a in args.values()) == [
        "ring",
        "ulysses",
        "ulysses",
    ]  # grpo's too
    for case in cases:
        assert smoke.context_parallel_size(case) == args[case.name].context_parallel_size == 2
        assert str(load_config_from_file(str(REPO_ROOT / case.config)).mixed_precision) == "bf16", case.name
        backend = args[case.name].attention_backend or "native"
        assert backend in context_parallel_backends(), case.name
        transformer = tiny_wan_components(WAN, vocab_size=64)["transformer"]
        if args[case.name].attention_backend:
            set_attention_backend(transformer, args[case.name].attention_backend)
        check_context_parallel(2, args[case.name].context_parallel_mode, 2, transformer, dtype=torch.bfloat16)
        if args[case.name].context_parallel_mode == "ring":
            with pytest.raises(ValueError, match="takes bf16 or fp16"):
                check_context_parallel(2, "ring", 2, transformer, dtype=torch.float32)

        reason = smoke.skip_reason(case, 1, 1)
        assert reason.startswith("needs 2 GPUs (context parallelism of 2"), reason
        assert reason.endswith("this host has 1)"), reason
        for (n, gpus), expected in {(1, 2): 2, (2, 2): 2, (3, 3): 2, (4, 8): 4, (8, 8): 8}.items():
            assert smoke.skip_reason(case, n, gpus) is None
            (launch,) = smoke.plan_launches(case, tmp_path, tmp_path / "run", n, gpus)
            command = smoke.launch_command(launch, 29500)
            assert command[command.index("--num_processes") + 1] == str(expected), (case.name, n, gpus)

    launched = []

    def no_launch(*args, **kwargs):
        raise AssertionError("a skipped case launched something")

    def fake_launch(argv, env, log_path, timeout):  # a run that reaches its last step
        launched.append(argv)
        with open(log_path, "a") as log:
            log.write(f"step {smoke.STEPS} loss 0.5\n")
        return 0

    monkeypatch.setattr(smoke, "OUT", tmp_path / "out")
    for case in cases:
        monkeypatch.setattr(smoke, "run_launch", no_launch)
        row = smoke.run_case(case, 1, 1, {}, tmp_path, 10)
        assert row["result"] == "skipped" and row["note"].startswith("needs 2 GPUs"), row
        monkeypatch.setattr(smoke, "run_launch", fake_launch)
        row = smoke.run_case(case, 1, 2, {}, tmp_path, 10)
        assert (row["result"], row["processes"], row["backends"]) == ("ok", "2", "nccl"), row
        assert launched[-1][launched[-1].index("--num_processes") + 1] == "2"
        assert f"| {case.name} | ok | 2 | nccl |" in smoke.format_table([(case.name, row)])


@pytest.mark.parametrize("num_processes, gpus", [(1, 2), (2, 2), (8, 8), (1, 1)])
def test_every_case_runs_collectives_where_the_host_has_two_gpus(smoke, tmp_path, num_processes, gpus):
    """Wherever the host has 2 GPUs every case has a launch of 2 processes or more (NCCL in its
    table row), ``NUM_PROCESSES=1`` included; the one exception is the real-size case, one process
    by design (ZeRO-3's hooks against the plain model). On a host of one GPU each case that runs
    is one process and its row says no collective ran."""
    for case in smoke.CASES:
        if smoke.skip_reason(case, num_processes, gpus):
            assert gpus == 1 and (case.mode == "reshard" or smoke.context_parallel_size(case) > 1), case.name
            continue
        launches = smoke.plan_launches(case, tmp_path, tmp_path / "run", num_processes, gpus)
        most = max(launch.num_processes for launch in launches)
        if case.mode == "versus-ddp" or gpus == 1:
            assert most == 1 and smoke.collective_backends(launches) == "none", case.name
        else:
            assert 2 <= most <= gpus and smoke.collective_backends(launches) == "nccl", case.name


def test_the_data_step_writes_the_built_in_reward_model(smoke, tmp_path, monkeypatch):
    """The GRPO case's ``clip_score`` reads ``<data>/tiny-clip``, which the data step writes (a
    hidden flag of the script, as SD 1.5's UNet); the folder loads as the built-in reward and
    scores images of the case's resolution."""
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs

    case = next(c for c in smoke.CASES if "clip_score=shard" in c.flags)
    data = tmp_path / "data"
    args = _parsers()["grpo"](_first_argv(smoke, case, data))
    assert f"clip_score={data / smoke.TINY_CLIP}" in args.reward_model
    calls = []
    monkeypatch.setattr(smoke, "run_launch", lambda argv, *a, **k: calls.append(argv) or 0)
    assert smoke.prepare_data([case], data, tmp_path / "data.log")
    written = [c[2:] for c in calls if "--write-tiny-clip" in c]
    assert written == [["--write-tiny-clip", str(data / smoke.TINY_CLIP)]]
    calls.clear()
    assert smoke.prepare_data([c for c in smoke.CASES if c.script != "grpo"], data, tmp_path / "data.log")
    assert not [c for c in calls if "--write-tiny-clip" in c]  # only for a case that reads it

    proc = subprocess.run(
        [sys.executable, "scripts/smoke_gpu.py", "--write-tiny-clip", str(data / smoke.TINY_CLIP)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    clip = data / smoke.TINY_CLIP
    specs = parse_reward_specs(["clip_score"], [f"clip_score={clip}"], ["clip_score=replicate"])
    rewards = load_rewards(specs, None, torch.float32)
    torch.manual_seed(0)
    total, scores = rewards(torch.rand(2, 3, 32, 32), ["a red circle", "a blue square"])
    assert total.shape == (2,) and torch.isfinite(total).all()


@pytest.mark.parametrize("num_processes, gpus", [(2, 2), (8, 8), (1, 2)])
def test_every_launch_parses(smoke, tmp_path, num_processes, gpus):
    """Every launch of every case: ``accelerate launch``'s parser takes the launcher's flags,
    and the script's own parser and checks (``validate_args``) take its flags."""
    from accelerate.commands.launch import launch_command_parser

    from diffusers_zero3.args import validate_common_args
    from diffusers_zero3.recipes.grpo import GRPO_FAMILIES
    from diffusers_zero3.recipes.text_to_image_settings import validate_args

    data = tmp_path / "data"
    (data / "controlnet-shapes-masks").mkdir(parents=True)
    (data / "controlnet-shapes-masks" / "circle.png").touch()  # train_controlnet.py checks the file
    parsers, launcher = _parsers(), launch_command_parser()
    for case in smoke.CASES:
        if smoke.skip_reason(case, num_processes, gpus):
            continue
        launches = smoke.plan_launches(case, data, tmp_path / "run", num_processes, gpus)
        assert launches, case.name
        for launch in launches:
            command = smoke.launch_command(launch, 29500)
            assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
            cli = launcher.parse_args(command[3:])
            assert cli.num_processes == launch.num_processes <= max(num_processes, gpus), case.name
            assert cli.training_script == smoke.SCRIPTS[case.script]
            assert Path(REPO_ROOT / cli.config_file).is_file() or cli.config_file == str(smoke.DDP_CONFIG)
            args = parsers[case.script](cli.training_script_args)
            (validate_common_args if case.script in ("reward", "grpo") else validate_args)(args)
            if case.script == "grpo":  # what its setup refuses before anything loads
                assert case.model in GRPO_FAMILIES, case.name
            assert args.max_train_steps == launch.steps, case.name
            # a checkpoint at step STEPS to resume from; none inside the timed steps
            if case.mode == "versus-ddp":
                assert args.checkpointing_steps > launch.steps and args.validation_prompts is None
            else:
                assert args.checkpointing_steps == smoke.STEPS, case.name
            assert f"\\bstep {launch.steps} " in launch.expect[0]


def test_family_cases_train_as_make_train_does(smoke, tmp_path):
    """A family case takes its family's own placements (``default_run_args``, HiDream's
    ``--component`` pointing into the data folder) and the dataset ``demo`` writes for it."""
    from diffusers_zero3.demo import training_data_folder
    from diffusers_zero3.families import family_named

    for case in (c for c in smoke.CASES if c.family_defaults):
        argv = smoke.case_argv(case, tmp_path, tmp_path / "run", smoke.STEPS)
        pipe = tmp_path / f"tiny-{case.model}"
        defaults = [a.format(pipeline=pipe) for a in family_named(case.model).default_run_args]
        start = argv.index(defaults[0])
        assert argv[start : start + len(defaults)] == defaults, case.name
        images = argv[argv.index("--train_data_dir") + 1]
        # the folder prepare_default writes for the family (smoke gave LTX-2 the clips without sound)
        assert images == str(tmp_path / training_data_folder(case.model)), case.name
    assert training_data_folder("ltx2") == "shapes-videos-audio"
    hidream = next(c for c in smoke.CASES if c.model == "hidream")
    argv = smoke.case_argv(hidream, tmp_path, tmp_path / "run", smoke.STEPS)
    assert f"text_encoder_4={tmp_path / 'tiny-hidream'}-llama" in argv


def test_resume_on_another_number_of_processes(smoke, tmp_path, monkeypatch):
    """N -> M on GPUs that exist, processes x batch kept so that the package's own resume check
    (``batches_to_skip``) accepts the checkpoint; on a host of one GPU the case is skipped,
    saying why, and launches nothing."""
    from diffusers_zero3.training.schedule import batches_to_skip

    assert smoke.reshard_counts(1, 1) is None and smoke.reshard_counts(1, 0) is None
    expected = {
        (1, 2): (1, 2),
        (2, 2): (2, 1),
        (3, 3): (3, 1),
        (4, 4): (4, 2),
        (6, 8): (6, 3),
        (8, 8): (8, 4),
    }
    for (n, gpus), counts in expected.items():
        assert smoke.reshard_counts(n, gpus) == counts
    case = next(c for c in smoke.CASES if c.mode == "reshard")
    for n, gpus in expected:
        first, again = smoke.plan_launches(case, tmp_path, tmp_path / "run", n, gpus)
        assert (first.num_processes, again.num_processes) == expected[(n, gpus)]
        batch = int(again.argv[again.argv.index("--train_batch_size") + 1])
        assert first.num_processes * smoke.BATCH == again.num_processes * batch
        state = {"batches_in_epoch": smoke.STEPS, "world_size": n, "train_batch_size": smoke.BATCH}
        assert batches_to_skip(state, again.num_processes, batch) == smoke.STEPS
        assert again.argv[-2:] == ("--resume_from_checkpoint", "latest")
        assert f"resharded for {again.num_processes}" in again.expect[-1]

    def no_launch(*args, **kwargs):
        raise AssertionError("a skipped case launched something")

    monkeypatch.setattr(smoke, "run_launch", no_launch)
    row = smoke.run_case(case, 1, 1, {}, tmp_path, 10)
    assert row["result"] == "skipped" and row["note"].startswith("needs 2 GPUs")
    assert "| skipped | - | - | 0.0 | n/a | needs 2 GPUs" in smoke.format_table([(case.name, row)])


def test_real_size_case_is_sd15_against_a_plain_accelerate_config(smoke, tmp_path):
    """The versus-ddp case trains SD 1.5's UNet at its published size (counted on the meta
    device) at N=1 under a non-DeepSpeed accelerate config with bf16, then ZeRO-3's bf16
    config, on 64 x 64 latents."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**smoke.sd15_unet_config())
    params = list(unet.parameters())
    assert (sum(p.numel() for p in params), len(params)) == (859_520_964, 686)
    assert (
        list(unet.config.block_out_channels) == [320, 640, 1280, 1280]
        and unet.config.cross_attention_dim == 768
    )
    case = next(c for c in smoke.CASES if c.mode == "versus-ddp")
    ddp, zero3 = smoke.plan_launches(case, tmp_path, tmp_path / "run", 8, 8)
    assert (ddp.label, ddp.num_processes, zero3.num_processes) == ("ddp", 1, 1)
    assert ddp.config == str(smoke.DDP_CONFIG) and zero3.config == smoke.ZERO3_BF16
    assert ddp.argv == tuple(smoke.case_argv(case, tmp_path, tmp_path / "run" / "ddp", ddp.steps))
    assert ddp.argv[ddp.argv.index("--pretrained_model_name_or_path") + 1] == str(
        tmp_path / smoke.SD15_PIPELINE
    )
    config_file = tmp_path / "ddp.yaml"
    config_file.write_text(smoke.DDP_CONFIG_TEXT)
    config = load_config_from_file(str(config_file))
    assert config.distributed_type == DistributedType.MULTI_GPU and str(config.mixed_precision) == "bf16"
    zero3_config = load_config_from_file(str(REPO_ROOT / zero3.config))
    assert (
        zero3_config.distributed_type == DistributedType.DEEPSPEED
        and str(zero3_config.mixed_precision) == "bf16"
    )
    assert smoke.PERF_RESOLUTION // 2 == 64  # the tiny VAE's x2: SD 1.5's latents at 512 px


def _memory_report(step_seconds: float, steps: int, peak_mib: float) -> str:
    from diffusers_zero3.runtime.memory import MIB, MemoryLog, PhaseMemory

    records = [
        PhaseMemory("first optimizer step", 10 * MIB, 20 * MIB, 100.0, 5 * MIB, 1024 * MIB, 2048 * MIB),
        PhaseMemory(
            "training done",
            10 * MIB,
            20 * MIB,
            100.0 + step_seconds * (steps - 1),
            5 * MIB,
            int(peak_mib * MIB),
            0,
        ),
    ]
    return f"step {steps} loss 0.5\nmemory per rank (maximum over ranks):\n" + MemoryLog.format(records)


def test_versus_ddp_note_reads_the_memory_reports(smoke):
    """Time per step is the last phase (steps 2..N) over N - 1; the peak the device peak."""
    ddp, zero3 = _memory_report(0.2, 20, 10 * 1024), _memory_report(0.25, 20, 8 * 1024)
    assert smoke.seconds_per_step(zero3, 20) == pytest.approx(0.25, abs=1e-3)
    assert smoke.versus_ddp_note(ddp, zero3, 20) == (
        "ZeRO-3 / DDP at N=1: time per step 1.25 x (0.250 / 0.200 s), device peak 0.80 x (8.00 / 10.00 GiB)"
    )
    assert "device peak n/a (n/a / 10.00 GiB)" in smoke.versus_ddp_note(ddp, "no report", 20)


def test_reads_the_device_peak_of_the_memory_report(smoke):
    """The table's peak column parses the trainer's own report (MemoryLog.format); a CPU
    report has no device numbers: n/a."""
    from diffusers_zero3.runtime.memory import MIB, MemoryLog, PhaseMemory

    gpu = [
        PhaseMemory("after prepare", 10 * MIB, 20 * MIB, 0.0, 5 * MIB, 1536 * MIB, 2048 * MIB),
        PhaseMemory("first backward", 10 * MIB, 20 * MIB, 1.0, 5 * MIB, 3072 * MIB, 4096 * MIB),
    ]
    log = "step 2 loss 0.5\nmemory per rank (maximum over ranks):\n" + MemoryLog.format(gpu)
    assert smoke.device_peak_gib(log) == pytest.approx(3.0, abs=1e-3)
    cpu = [PhaseMemory("after prepare", 10 * MIB, 20 * MIB, 0.0)]
    assert smoke.device_peak_gib(MemoryLog.format(cpu)) is None
    rows = [
        ("a", {"result": "ok", "seconds": 1.25, "peak": 3.0, "note": "", "processes": "2", "backends": "nccl"}),
        ("b", {"result": "timeout", "seconds": 9, "peak": None, "note": "train: killed after 9 s",
               "processes": "2 -> 1", "backends": "nccl"}),
    ]  # fmt: skip
    assert smoke.format_table(rows).splitlines()[2:] == [
        "| a | ok | 2 | nccl | 1.2 | 3.00 |  |",
        "| b | timeout | 2 -> 1 | nccl | 9.0 | n/a | train: killed after 9 s |",
    ]


def test_case_selection(smoke):
    assert [c.name for c in smoke.select_cases("")] == [c.name for c in smoke.CASES]
    names = [smoke.CASES[3].name, smoke.CASES[0].name]
    assert [c.name for c in smoke.select_cases(",".join(names))] == names[::-1]  # the matrix's order
    with pytest.raises(ValueError, match="unknown case"):
        smoke.select_cases("no-such-case")


def test_list_prints_every_case(smoke):
    proc = subprocess.run(
        [sys.executable, "scripts/smoke_gpu.py", "--list"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == [c.name for c in smoke.CASES]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_refuses_a_host_without_cuda():
    proc = subprocess.run(
        [sys.executable, "scripts/smoke_gpu.py"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == "error: make smoke-gpu needs a CUDA GPU (none found)"


def test_docs_list_every_case(smoke):
    """docs/gpu.md names every case and says how many there are."""
    text = (REPO_ROOT / "docs" / "gpu.md").read_text()
    assert [c.name for c in smoke.CASES if f"`{c.name}`" not in text] == []
    assert f"the {len(smoke.CASES)} cases" in text
