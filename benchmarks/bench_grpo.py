"""Online RL with sharded rewards (issue 37, item 7), N=2 CPU ranks.

(a) A Qwen2-VL judge (the ``vlm`` built-in, ``rewards.builtin.VLMJudge``) built from a config of
    a few hundred MB, saved locally with its tokenizer and image processor config, loaded through
    ``rewards.load_rewards`` placed ``shard`` and ``replicate``: its parameter bytes per rank, the
    RSS per rank after placement and its peak while scoring, and the time per scored sample; the
    planner's bytes per rank for the same folder (``PlanOptions(reward_models=...)``) at N=2 and 8.
(b) ``scripts/train_grpo.py`` on the tiny SD3 of ``make train-grpo`` for a few rounds: the split of
    a round's time between sampling, rewards and training (``rewards.json``'s ``"seconds"``), with
    the redness function alone and with the judge of (a) added, sharded.
(c) The same runs as full fine-tuning under ZeRO-3 and as LoRA (``--rank 4``): peak RSS per rank
    (the largest process of the launch, from ``getrusage``) and seconds per round, beside the
    planner's model-state bytes per rank for this SD3 and for SD3 Medium at N=8.

``python -m benchmarks.run --only grpo`` (or ``python -m benchmarks.bench_grpo``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT, markdown_table, mib, print_section, report, run_case

# The judge: a Qwen2-VL with Qwen2-VL's patch, merge and temporal sizes, narrow and shallow.
VLM_TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=32000)  # fmt: skip
VLM_VISION = dict(depth=8, embed_dim=512, num_heads=8, mlp_ratio=4)
# The same judge at a VLM's layer count (Qwen2-VL-7B's 28 decoder layers and 32 vision blocks):
# the number of gathers per forward, which the sharded judge's time follows, as in a real judge.
VLM_DEEP = (dict(VLM_TEXT, num_hidden_layers=28), dict(VLM_VISION, depth=32))
SAMPLES, REPEAT, IMAGE = 8, 3, 64  # samples per rank per call, timed calls, image side (px)
ROUNDS = 6  # GRPO rounds per run; the first one is left out of the times (it warms up)
GRPO_PROMPTS = ("a red circle", "a blue square", "a green circle", "a yellow square")


# ------------------------------------------------------------------ (a) the judge


def write_vlm_judge(folder: Path, text: dict = VLM_TEXT, vision: dict = VLM_VISION) -> Path:
    """A Qwen2-VL judge of ``text`` / ``vision`` (``VLM_TEXT`` / ``VLM_VISION``) with its tokenizer (byte-level, Qwen2-VL's
    special tokens, "Yes" and "No" one token each) and image processor config, as a hub folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.demo.tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen2_tokenizer
    from diffusers_zero3.rewards.builtin import DEFAULT_VLM_QUESTION

    words = ("Yes", "No", "system", "user", "assistant", "You are a helpful assistant.", DEFAULT_VLM_QUESTION)
    write_qwen2_tokenizer(folder, QWEN_VL_SPECIAL_TOKENS, texts=words + GRPO_PROMPTS)
    tok = AutoTokenizer.from_pretrained(folder)
    tid = tok.convert_tokens_to_ids
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    quarter = head_dim // 8  # mrope sections (temporal, height, width) summing to head_dim / 2
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(**text, max_position_embeddings=1024,
                         rope_scaling={"mrope_section": [2 * quarter, quarter, quarter], "rope_type": "default"},
                         bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                         pad_token_id=tid("<|endoftext|>")),
        vision_config=dict(**vision, hidden_size=text["hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=False,
    )  # fmt: skip
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    return folder


def _rss_parts() -> dict[str, int]:
    """This process's resident bytes by kind (``/proc/self/status``): anonymous memory (the heap,
    tensors) and file-backed pages (a safetensors file mapped by ``from_pretrained``)."""
    parts = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("RssAnon:", "RssFile:")):
                parts[line.split(":")[0]] = int(line.split()[1]) * 1024
    return parts


def case_vlm(folder: str, placement: str):
    """On every rank: load and place the judge, score ``SAMPLES`` images ``REPEAT`` times."""
    import torch
    from accelerate.utils import DeepSpeedPlugin

    from benchmarks.common import (
        current_rss_bytes,
        peak_rss_bytes,
        peak_rss_since_reset_bytes,
        reset_peak_rss,
    )
    from diffusers_zero3 import build_accelerator
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from diffusers_zero3.runtime.memory import heap_bytes

    cfg = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "zero_optimization": {"stage": 3}}
    acc = build_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    before = current_rss_bytes()
    specs = parse_reward_specs(["vlm"], [f"vlm={folder}"], [f"vlm={placement}"])
    rewards = load_rewards(specs, acc, torch.float32)
    held = rewards.rewards["vlm"].model.local_parameter_bytes()
    placed, placed_parts = current_rss_bytes(), _rss_parts()
    torch.manual_seed(acc.process_index)
    images = torch.rand(SAMPLES, 3, IMAGE, IMAGE)
    prompts = [GRPO_PROMPTS[i % len(GRPO_PROMPTS)] for i in range(SAMPLES)]
    reset_peak_rss()
    rewards(images, prompts)  # warm-up
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(REPEAT):
        total, _ = rewards(images, prompts)
    torch.distributed.barrier()
    seconds = (time.perf_counter() - start) / (REPEAT * SAMPLES * acc.num_processes)
    heap = heap_bytes() or (0, 0, 0)
    report(
        held=held,
        anon_placed=placed_parts.get("RssAnon", 0),
        file_placed=placed_parts.get("RssFile", 0),
        anon_scored=_rss_parts().get("RssAnon", 0),
        file_scored=_rss_parts().get("RssFile", 0),
        heap_in_use=heap[0] + heap[2],
        heap_held=heap[1],
        rss_before=before,
        rss_placed=placed,
        peak=peak_rss_bytes(),  # the whole run's, load included (getrusage: not reset above)
        score_peak=peak_rss_since_reset_bytes(),
        seconds_per_sample=seconds,
        mean_score=float(total.mean()),
    )


def planned_bytes(pipe: Path, folder: Path, n: int) -> dict[str, int]:
    """The planner's bytes per rank of the judge by placement at ``n`` ranks (fp32)."""
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    plan = make_plan(str(pipe), PlanOptions(num_processes=n, reward_models={"vlm": str(folder)}))
    comp = plan["components"]["reward:vlm"]
    return {
        "parameters": comp["parameters"],
        **{p: v["bytes_per_rank"] for p, v in comp["placements"].items()},
    }


# The runs of the judge: (label, placement, environment of the ranks)
VLM_RUNS = (
    ("replicate", "replicate", None),
    ("shard", "shard", None),
    ("shard, MALLOC_MMAP_THRESHOLD_=1 MiB", "shard", {"MALLOC_MMAP_THRESHOLD_": "1048576"}),
)


def vlm_rows(pipe: Path, folder: Path) -> tuple[list[dict], list[dict], int]:
    results = {
        label: run_case(
            "benchmarks.bench_grpo:case_vlm", folder=str(folder), placement=p, env=env, timeout_s=900
        )
        for label, p, env in VLM_RUNS
    }
    plans = {n: planned_bytes(pipe, folder, n) for n in (2, 8)}
    base = {k: max(r[k] for r in results["replicate"]) for k in results["replicate"][0]}
    rows = []
    for (label, placement, _), res in zip(VLM_RUNS, results.values()):
        r = {k: max(x[k] for x in res) for k in res[0]}
        rows.append(
            {
                "judge placement": label,
                "judge MiB / rank": mib(r["held"]),
                "bytes vs replicate": f"{r['held'] / base['held']:.2f}",
                "planned MiB / rank": mib(plans[2][placement]),
                "measured / planned": f"{r['held'] / plans[2][placement]:.3f}",
                "RSS after placement MiB (anon + file)": f"{mib(r['rss_placed'])} ({mib(r['anon_placed'])} + {mib(r['file_placed'])})",
                "vs replicate": f"{r['rss_placed'] / base['rss_placed']:.2f}",
                "peak RSS while scoring MiB": mib(r["score_peak"]),
                "vs replicate ": f"{r['score_peak'] / base['score_peak']:.2f}",
                "RSS after scoring, anon + file MiB": f"{mib(r['anon_scored'])} + {mib(r['file_scored'])}",
                "glibc freed but held MiB": mib(r["heap_held"]),
                "peak RSS MiB, whole run": mib(r["peak"]),
                "ms / scored sample": f"{r['seconds_per_sample'] * 1e3:.1f}",
                "time vs replicate": f"{r['seconds_per_sample'] / base['seconds_per_sample']:.2f}",
            }
        )
    plan_rows = [
        {
            "N": n,
            "replicate MiB / rank": mib(p["replicate"]),
            "shard MiB / rank": mib(p["shard"]),
            "shard / replicate": f"{p['shard'] / p['replicate']:.3f}",
            "shard / (replicate / N)": f"{p['shard'] * n / p['replicate']:.3f}",
        }
        for n, p in plans.items()
    ]
    return rows, plan_rows, plans[2]["parameters"]


# ------------------------------------------------------------------ (b, c) the script


def run_grpo(pipe: Path, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """``scripts/train_grpo.py`` on 2 CPU ranks, ``make train-grpo``'s settings for ``ROUNDS``
    rounds; its ``rewards.json``, the peak RSS of its largest process and its wall time."""
    from diffusers_zero3.testing import free_port

    argv = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO_ROOT / "configs" / "accelerate_zero3.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()),
        str(REPO_ROOT / "scripts" / "train_grpo.py"),
        "--pretrained_model_name_or_path", str(pipe), "--prompts", *GRPO_PROMPTS,
        "--reward", "diffusers_zero3.demo.rewards:redness", "--objective", "nft", "--group_size", "4",
        "--output_dir", str(out), "--resolution", "32", "--num_inference_steps", "6",
        "--sample_batch_size", "8", "--train_batch_size", "8", "--max_train_steps", str(ROUNDS),
        "--learning_rate", "3e-3", "--checkpointing_steps", "100000", "--seed", "0", "--report_to", "none",
        *extra,
    ]  # fmt: skip
    # A fresh process runs the launch, so that its RUSAGE_CHILDREN is this launch's alone: the
    # largest resident set of any process it waited for (a rank; the launcher is smaller).
    wrapper = (
        "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stdout.write(p.stdout + p.stderr); "
        "print('GRPO_RUN ' + json.dumps({'rc': p.returncode, 'wall': time.perf_counter() - t, "
        "'peak': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))"
    )
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO_ROOT),
        "ACCELERATE_USE_DEEPSPEED": "true",
    }
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *argv], env=env, capture_output=True, text=True, timeout=1800
    )
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("GRPO_RUN ")]
    run = json.loads(lines[-1][len("GRPO_RUN ") :]) if lines else {"rc": proc.returncode}
    if run["rc"] != 0:
        raise RuntimeError(f"train_grpo.py failed ({run['rc']}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return {**run, "rewards": json.loads((out / "rewards.json").read_text())}


def split(run: dict) -> dict[str, float] | None:
    """Mean seconds per round of each phase over the rounds after the first, or None when the
    script's ``rewards.json`` has no ``"seconds"``."""
    seconds = run["rewards"].get("seconds")
    if not seconds:
        return None
    return {phase: sum(v[1:]) / max(1, len(v) - 1) for phase, v in seconds.items()}


def model_states(pipeline: str, n: int, mixed_precision: str, rank: int | None) -> tuple[int, int]:
    """The planner's trained-model state bytes per rank (parameters, gradients, optimizer state)
    and, for full fine-tuning, a sharded reference's bytes (a KL term needs one), at ``n`` ranks."""
    from diffusers_zero3.placement.plan import PlanOptions, make_plan

    options = PlanOptions(num_processes=n, mixed_precision=mixed_precision, rank=rank, reference=rank is None)
    comps = make_plan(pipeline, options)["components"]
    denoiser = next(c for c in comps.values() if c["trainable"])["placements"]["shard"]
    states = sum(denoiser[k] for k in ("parameters", "gradients", "optimizer"))
    reference = comps["reference"]["placements"]["shard"]["bytes_per_rank"] if "reference" in comps else 0
    return states, reference


PUBLISHED_SD3 = "stabilityai/stable-diffusion-3-medium-diffusers"
# (label, output folder, extra flags); the judge run is the full run with the judge added
GRPO_RUNS = (
    ("full fine-tuning (ZeRO-3)", "full", ()),
    ("LoRA rank 4", "lora", ("--rank", "4")),
)


def grpo_rows(pipe: Path, work: Path, judge: Path) -> tuple[list[dict], list[dict]]:
    judge_flags = ("--reward", "vlm", "--reward_model", f"vlm={judge}", "--reward_placement", "vlm=shard")
    runs = {label: run_grpo(pipe, work / name, extra) for label, name, extra in GRPO_RUNS}
    runs["full fine-tuning + the VLM judge (sharded)"] = run_grpo(pipe, work / "judge", judge_flags)
    split_rows, side_rows = [], []
    for name, run in runs.items():
        parts = split(run)
        if parts:
            per_round = sum(parts.values())
            split_rows.append(
                {
                    "run": name,
                    "s / round": f"{per_round:.2f}",
                    **{f"{k} s": f"{v:.2f} ({v / per_round:.0%})" for k, v in parts.items()},
                }
            )
    base = None
    for (label, _, extra), run in zip(GRPO_RUNS, runs.values()):
        parts = split(run)
        per_round = sum(parts.values()) if parts else None
        rank = 4 if extra else None
        tiny, _ = model_states(str(pipe), 2, "no", rank)
        big, ref = model_states(PUBLISHED_SD3, 8, "bf16", rank)
        base = base or (run["peak"], per_round, run["wall"], tiny, big + ref)
        side_rows.append(
            {
                "training": label,
                "peak RSS MiB / rank (max)": mib(run["peak"]),
                "RSS vs full": f"{run['peak'] / base[0]:.2f}",
                "s / round": f"{per_round:.2f}" if per_round else 'missing (no "seconds" in rewards.json)',
                "time vs full": f"{per_round / base[1]:.2f}" if per_round and base[1] else "",
                f"launch wall s ({ROUNDS} rounds)": f"{run['wall']:.1f}",
                "planned model states KiB / rank (this SD3, fp32)": f"{tiny / 2**10:.0f}",
                "vs full": f"{tiny / base[3]:.3f}",
                "planned GiB / rank, SD3 Medium, N=8, bf16 (+ sharded reference)": (
                    f"{(big + ref) / 2**30:.2f}"
                    + (f" ({big / 2**30:.2f} + {ref / 2**30:.2f})" if ref else "")
                ),
                "vs full ": f"{(big + ref) / base[4]:.3f}",
            }
        )
    return split_rows, side_rows


# ------------------------------------------------------------------ main


def main() -> None:
    from diffusers_zero3.demo import save_tiny_pipeline
    from diffusers_zero3.families import SD3

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pipe = save_tiny_pipeline(SD3, work / "tiny-sd3")
        folder = write_vlm_judge(work / "vlm")
        judge, plan, params = vlm_rows(pipe, folder)
        deep, _, deep_params = vlm_rows(pipe, write_vlm_judge(work / "vlm-deep", *VLM_DEEP))
        splits, side = grpo_rows(pipe, work, folder)
    for rows, n, layers in ((judge, params, "8 + 8"), (deep, deep_params, "28 + 32, a VLM's")):
        print_section(
            f"VLM judge (Qwen2-VL, {n / 1e6:.1f} M parameters, {layers} layers, fp32), {SAMPLES} images of"
            f" {IMAGE} px per rank per call, N=2, CPU",
            markdown_table(rows, list(rows[0])),
        )
    print_section(
        "The planner's bytes per rank for the same judge (fp32)", markdown_table(plan, list(plan[0]))
    )
    title = f"train_grpo.py on the tiny SD3 (nft, 4 prompts x 4, 6 steps, 32 px), rounds 2-{ROUNDS}, N=2, CPU"
    if splits:
        print_section(f"Split of a round: {title}", markdown_table(splits, list(splits[0])))
    else:
        print('\n(the split of a round: rewards.json has no "seconds" yet)\n')
    print_section(f"Full fine-tuning against LoRA: {title}", markdown_table(side, list(side[0])))


if __name__ == "__main__":
    main()
