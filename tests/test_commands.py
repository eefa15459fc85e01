"""The commands a user types: every command in README.md and docs/*.md parses as printed, the
console commands launch (and fail with one ``error:`` line), and ``accelerate``'s own console
command works in the installed environment.

Documented commands that name a hub model or a user's folder cannot run here: each is checked
as far as it can be without them (the launcher's options parse, its config file and script
exist, the script's flags parse, a ``make`` target exists). The embedded defaults themselves run
in the e2e tier (``make train*`` runs the scripts the e2e tests launch).
"""

from __future__ import annotations

import configparser
import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed_harness import REPO_ROOT, run_launchers_side_by_side

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
INLINE_MAKE = re.compile(r"`(make [^`]+)`")


def documented_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every shell command in a bash (or bare) fenced block of the
    README and the docs (continuation lines joined, comments dropped, ``a && b`` split), and
    every inline ``make ...`` span."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) not in ("", "bash", "sh", "shell", "console"):
                continue
            body = re.sub(r"\\\n\s*", " ", match.group(2))
            for line in body.splitlines():
                line = line.split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    found += [(doc.name, part.strip()) for part in line.split("&&")]
        # inline spans, but not a placeholder's (`make train MODEL=<name>`)
        found += [(doc.name, m.group(1)) for m in INLINE_MAKE.finditer(text) if "<" not in m.group(1)]
    return found


def console_scripts() -> dict[str, str]:
    """``{command: module:function}`` of setup.cfg's console entry points."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(s.strip() for s in line.split("=")) for line in lines)


def _settings_for(script_or_module: str):
    """The settings class behind a training script (``scripts/train_x.py``), command module or
    console command (``commands.TRAINERS``); None for another file."""
    from diffusers_zero3.commands import TRAINERS, settings_class

    name = re.split(r"[./]", script_or_module.removesuffix(".py"))[-1].replace("-", "_")
    command = "train_" + name.partition("train_")[2]
    return settings_class(command) if command in TRAINERS else None


def _parse_flags(settings, flags: list[str], command: str) -> None:
    """Parse ``flags`` as the script would; where the command leaves the rest to the user
    (``...``), its required flags may be among what is left out."""
    from diffusers_zero3.args import settings_parser

    parser = settings_parser(settings)
    if "..." in command:
        flags = flags + [a for action in parser._actions if action.required and not set(action.option_strings) & set(flags)
                         for a in (action.option_strings[0], "X")]  # fmt: skip
    try:
        parser.parse_args(flags)
    except SystemExit as e:
        assert e.code == 0, f"the flags of `{command}` do not parse (exit {e.code})"


def check_command(command: str) -> None:
    """Check one documented command as far as it runs without a hub or the user's folders.
    A synopsis's optional ``[--flag ...]`` groups are left out, ``$VARIABLE`` stands for 0 and
    ``...`` for what the user adds."""
    command = re.sub(r"\$[A-Z_]+", "0", re.sub(r"\s\[[^\]]*\]", "", command))
    argv = [a for a in shlex.split(command) if a != "..."]
    scripts = console_scripts()
    if argv[0] == "make":
        done = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"`{command}`: {done.stderr.strip()}"
    elif argv[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(argv[2:])
        if args.config_file:
            assert (REPO_ROOT / args.config_file).is_file(), f"`{command}`: no {args.config_file}"
        if args.module:
            assert args.training_script.startswith("diffusers_zero3.commands."), command
        else:
            assert (REPO_ROOT / args.training_script).is_file(), f"`{command}`: no {args.training_script}"
        settings = _settings_for(args.training_script)
        if settings is not None:
            _parse_flags(settings, args.training_script_args, command)
        else:
            assert args.training_script.startswith("examples/"), f"`{command}`: which script is this?"
    elif argv[0] in scripts or argv[:3] == ["python", "-m", "diffusers_zero3.placement.plan"]:
        if "plan" in argv[0] or "plan" in " ".join(argv[:3]):
            from diffusers_zero3.placement.plan import parser

            parser().parse_args(argv[1 if argv[0] in scripts else 3 :])
        else:
            from diffusers_zero3.commands import split_launch_flags

            _parse_flags(_settings_for(argv[0]), split_launch_flags(argv[1:])[1], command)
    elif argv[0] == "python" and argv[1].startswith("scripts/"):
        assert (REPO_ROOT / argv[1]).is_file(), command
    else:
        pytest.fail(f"a documented command this test does not know how to check: `{command}`")


@pytest.mark.unit
def test_every_documented_command_parses_as_printed():
    commands = documented_commands()
    kinds = {c.split()[0] for _, c in commands}
    assert {"make", "accelerate", "diffusers-zero3-train-text-to-image"} <= kinds, (
        kinds
    )  # the extractor finds them
    failures = []
    for where, command in commands:
        try:
            check_command(command)
        except (AssertionError, SystemExit, Exception) as e:  # noqa: B014 (all of them are a broken command)
            failures.append(f"{where}: {command}\n    {type(e).__name__}: {e}")
    assert not failures, "documented commands that do not work as printed:\n" + "\n".join(failures)


@pytest.mark.unit
def test_the_check_catches_a_broken_command():
    """Positive controls: a misspelt flag, a missing config, a missing make target fail."""
    for broken in (
        "accelerate launch --config_file configs/accelerate_zero3.yaml scripts/train_text_to_image.py --resolutoin 8",
        "accelerate launch --config_file configs/nope.yaml scripts/train_text_to_image.py",
        "diffusers-zero3-train-grpo --rewrd x",
        "make trian",
    ):
        with pytest.raises((AssertionError, SystemExit)):
            check_command(broken)


@pytest.mark.unit
def test_every_script_has_a_console_command_and_a_module():
    scripts = console_scripts()
    for script in sorted((REPO_ROOT / "scripts").glob("train_*.py")):
        command = "diffusers-zero3-" + script.stem.replace("_", "-")
        assert command in scripts, f"{script.name} has no console command {command}"
        module, _, function = scripts[command].partition(":")
        assert module == f"diffusers_zero3.commands.{script.stem}" and function == "main"
        assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file()


@pytest.mark.unit
def test_launch_flags_lead_the_command_line():
    from diffusers_zero3.commands import split_launch_flags

    assert split_launch_flags(["--num_processes", "4", "--config_file=c.yaml", "--resolution", "8"]) == (
        {"num_processes": "4", "config_file": "c.yaml"},
        ["--resolution", "8"],
    )
    # after the script's first flag, a launch flag's name is the script's own
    assert split_launch_flags(["--resolution", "8", "--num_processes", "4"]) == (
        {},
        ["--resolution", "8", "--num_processes", "4"],
    )


@pytest.mark.unit
def test_a_malformed_command_line_is_one_error_line(capfd):
    from diffusers_zero3.recipes.text_to_image_settings import TextToImageSettings

    with pytest.raises(SystemExit) as exit_:
        TextToImageSettings.parse(["--resolution", "abc"])
    err = capfd.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err == ["error: argument --resolution: invalid int value: 'abc' (--help lists the flags)"], err


_CLAIM = "from diffusers_zero3.runtime.user_errors import claim_error_report; print(claim_error_report())"


@pytest.mark.unit
def test_one_local_rank_reports_a_user_error(tmp_path):
    """Three 'ranks' of one launcher (this process is their parent) ask at once: one claims
    the report. Control: outside a launch each would print."""
    from diffusers_zero3.runtime.user_errors import error_claim_path

    claim = error_claim_path(os.getpid())
    claim.unlink(missing_ok=True)

    def ask(launched: bool, ranks: int = 3) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
        if launched:
            env.update(LOCAL_RANK="0", WORLD_SIZE=str(ranks))
        procs = [subprocess.Popen([sys.executable, "-c", _CLAIM], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(ranks)]  # fmt: skip
        return sorted(p.communicate(timeout=60)[0].strip() for p in procs)

    try:
        assert ask(launched=False) == ["True", "True", "True"]
        assert ask(launched=True) == ["False", "False", "True"]
        # a claim older than its launcher (a reused pid) is stale: taken over by one rank alone,
        # however the ranks' checks interleave (two that both saw it stale once both printed)
        for _ in range(6):
            os.utime(claim, (time.time() - 10**7,) * 2)
            assert ask(launched=True, ranks=4) == ["False", "False", "False", "True"]
    finally:
        claim.unlink(missing_ok=True)
        claim.with_name(f"{claim.name}.lock").unlink(missing_ok=True)


@pytest.mark.unit
def test_two_ranks_that_both_find_the_claim_stale_do_not_both_report(monkeypatch):
    """The race CI met: two ranks both find the claim stale before either takes it over, and
    the slower one's unlink removes the faster one's new claim: both printed. Two threads are
    held together after each read the stale claim's time, and the second to unlink waits until the
    first has claimed (at most 2 s: with the lock it never has to). Exactly one claims."""
    import pathlib
    import threading

    from diffusers_zero3.runtime import user_errors

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    claim = user_errors.error_claim_path(os.getppid())
    claim.touch()
    os.utime(claim, (time.time() - 10**7,) * 2)  # older than its launcher: stale
    together, first_claimed, unlinks = threading.Barrier(2, timeout=2), threading.Event(), []
    real_unlink, real_stat = pathlib.Path.unlink, pathlib.Path.stat

    def stat(path, **kwargs):
        result = real_stat(path, **kwargs)
        if path == claim:  # both have read the stale claim's time before either goes on
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait()
        return result

    def unlink(path, missing_ok=False):
        if path == claim:
            unlinks.append(threading.get_ident())
            if len(unlinks) > 1:
                first_claimed.wait(2)
        real_unlink(path, missing_ok=missing_ok)

    def rank() -> None:
        answers.append(user_errors.claim_error_report())
        if answers[-1]:
            first_claimed.set()

    monkeypatch.setattr(user_errors, "process_start_time", lambda pid: time.time() - 10**6)
    monkeypatch.setattr(pathlib.Path, "stat", stat)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    answers: list[bool] = []
    threads = [threading.Thread(target=rank) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(answers) == [False, True], answers
    finally:
        monkeypatch.undo()
        claim.unlink(missing_ok=True)
        claim.with_name(f"{claim.name}.lock").unlink(missing_ok=True)


@pytest.mark.unit
def test_a_stale_build_lock_is_named_with_its_remedy(tmp_path, monkeypatch, capsys):
    from diffusers_zero3.runtime.launch import stale_build_locks, warn_about_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    old.parent.mkdir(parents=True)
    old.touch()
    os.utime(old, (time.time() - 3600,) * 2)
    (tmp_path / "py311_cpu" / "other").mkdir()
    (tmp_path / "py311_cpu" / "other" / "lock").touch()  # made after `since`: this launch's own
    assert stale_build_locks(time.time() - 60) == [old]
    warn_about_build_locks(stale_build_locks(time.time() - 60))
    assert f"rm {old}" in capsys.readouterr().err


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


@pytest.mark.e2e
def test_console_commands_and_accelerate_launch(default_data, tmp_path):
    """After `make install`: `accelerate launch --help` and `accelerate env` work (a real 2-rank
    `accelerate launch -m` of a command module trains in tests/test_train_text_to_image.py); the
    console commands give one `error:` line, no traceback and exit status 2 for a bad
    resolution, a missing model folder and a misspelt reward."""
    from diffusers_zero3.testing import free_port

    pipe, data, _ = default_data
    accelerate = str(BIN / "accelerate")
    for sub in (["launch", "--help"], ["env"]):
        done = subprocess.run([accelerate, *sub], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"accelerate {' '.join(sub)}:\n{done.stderr[-3000:]}"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    common = [
        "--train_data_dir",
        data,
        "--resolution",
        "32",
        "--train_batch_size",
        "2",
        "--report_to",
        "none",
    ]
    t2i = str(BIN / "diffusers-zero3-train-text-to-image")

    def port() -> list[str]:
        return ["--main_process_port", str(free_port())]

    runs = [
        {"argv": [t2i, *port(), "--pretrained_model_name_or_path", pipe, *common[:2], "--resolution", "30",
                  "--output_dir", str(tmp_path / "bad-resolution")], "expect_rc": 2},
        {"argv": [t2i, *port(), "--pretrained_model_name_or_path", str(tmp_path / "missing"), *common,
                  "--output_dir", str(tmp_path / "missing-model")], "expect_rc": 2},
        {"argv": [str(BIN / "diffusers-zero3-train-grpo"), *port(), "--pretrained_model_name_or_path", pipe,
                  "--prompt_file", str(prompts), "--reward", "rednes", "--output_dir", str(tmp_path / "bad-reward")],
         "expect_rc": 2},
    ]  # fmt: skip
    results = run_launchers_side_by_side(runs, timeout=600)
    wanted = ["--resolution must be divisible by 8", "does not exist", "--reward rednes"]
    for (_, out), text in zip(results, wanted):
        errors = _error_lines(out)
        assert len(errors) == 1 and text in errors[0], out[-3000:]
        assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
        assert out.rstrip().splitlines()[-1].startswith("error:"), out[-3000:]  # nothing after it
    for name in ("bad-resolution", "missing-model", "bad-reward"):
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())
