"""The planner's RL mode: the bytes per rank of an online RL job (``train_grpo.py``, GRPO or
DiffusionNFT) and which placements of its frozen models fit.

    diffusers-zero3-plan Qwen/Qwen-Image --rl grpo --reward pickscore --reward vlm \\
        --reference --num_processes 8 --device_memory 80GiB --mixed_precision bf16 \\
        --resolution 1024 --group_size 24 --prompts_per_round 48 --num_inference_steps 10

On top of the plain plan (the policy, full or LoRA with ``--rank``; the pipeline's frozen
models; ``--reference``; ``--reward_model NAME=FOLDER``) it counts what the RL recipe holds:

* each ``--reward NAME`` (repeatable), a built-in reward sized from its published config
  written once in ``families.published`` (``PUBLISHED_REWARDS``: no hub, no folder), in the
  dtype the recipe runs it in: fp32 for the CLIP and BLIP scorers (``rewards.builtin``'s
  ``BuiltinReward.dtype``), the run's dtype for a VLM judge (``vlm``, ``hpsv3``,
  ``unifiedreward``, ``unifiedreward_video``, ``pairwise_vlm``; not the KV cache of the UnifiedReward judges'
  generated answers); ``replicate``,
  ``shard`` or ``offload`` (``--reward_placement``), never cached;
* the round (``ROUND_FIELDS``, ``recipes.grpo.Round``): each rank's ``samples_per_rank``
  samples (``ceil(prompts_per_round x group_size / (N / K))``), each with its latents at every
  step ``(T + 1)`` and log-probabilities ``T`` in fp32 (the recipe keeps every step even with an
  SDE window: the window saves time, not this memory), each step's mean under ``--ratio_norm``,
  its prompt's conditioning (and the empty prompt's under CFG) in the training dtype, the decoded
  images in fp32 until they are scored, and, for DiffusionNFT, the training points ``(x_t,
  v_old)`` of every inner epoch and trained step;
* DiffusionNFT's old policy (``--nft_decay_type`` 1 or 2): an fp32 average of the trained
  partitions (``4Ψ/N``, the adapters' under LoRA) and, while it samples, the stored trained
  partition it swaps out (``bΨ/N``).

The round and the old policy stay on the device for the whole round: they come off the budget
(the device memory less the margin) before the models are placed. The plan's ``rl`` part lists
every combination of placements of the RL models (the reference and each reward), the other
components placed by the planner's rule for what is left, with its total and whether it fits.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
from dataclasses import dataclass, field, replace

import torch

from ..families.published import (
    BLIP_VIT_L16,
    CLIP_VIT_H14,
    CLIP_VIT_L14,
    IMAGEREWARD_TEXT,
    QWEN2_VL_7B,
    REWARD_HEAD,
)
from ..families.qwenimage import PUBLISHED_TEXT_ENCODER as QWEN2_5_VL_7B
from ..runtime.ds_config import resolve_dtype
from .frozen import placement_bytes_per_rank
from .plan import GIB, MIB, PlanOptions, _plan, format_table, job_components, plan_notes, recommend

OBJECTIVES = ("grpo", "nft")
RL_MODEL_PLACEMENTS = ("replicate", "shard", "offload")  # the recipe's --reward_placement choices


# ---------------------------------------------------------------------------- reward models


@dataclass(frozen=True)
class PublishedReward:
    """A built-in reward model at its published size.

    Attributes:
        name: the planner's ``--reward`` name (``vlm:<model>`` for a judge of another size).
        builtin: the recipe's ``--reward`` built-in it sizes (``rewards.builtin.BUILTINS``).
        hub_id: the published weights.
        parts: ``(library, class, config, constructor keywords)`` of each model it holds.
        head: the widths of an MLP head on top (ImageReward's, the aesthetic predictor's).
        fp32: the recipe runs it in fp32 whatever the training dtype (the CLIP and BLIP scorers);
            False: in the training dtype (a VLM judge).
    """

    name: str
    builtin: str
    hub_id: str
    parts: tuple[tuple[str, str, dict, dict], ...]
    head: tuple[int, ...] = ()
    fp32: bool = True

    @property
    def class_name(self) -> str:
        return "+".join([cls for _, cls, _, _ in self.parts] + (["MLP"] if self.head else []))

    def dtype(self, mixed_precision: str) -> torch.dtype:
        """The dtype its weights are held in for a run of ``mixed_precision``."""
        return torch.float32 if self.fp32 else resolve_dtype(mixed_precision, {}, None)

    def meta_module(self) -> torch.nn.Module:
        """Its models (and head) built on the meta device from the configs: exact shapes, no
        weights."""
        from ..runtime.zero3 import zero3_init_disabled

        modules = torch.nn.ModuleList()
        with zero3_init_disabled(), torch.device("meta"):
            for library, class_name, config, kwargs in self.parts:
                cls = getattr(importlib.import_module(library), class_name)
                modules.append(cls(cls.config_class(**config), **kwargs))
            if self.head:
                layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(self.head)]
                modules.append(torch.nn.Sequential(*layers))
        return modules


def _clip(name: str, hub_id: str, config: dict, builtin: str | None = None) -> PublishedReward:
    return PublishedReward(name, builtin or name, hub_id, (("transformers", "CLIPModel", config, {}),))


def _vlm(name: str, hub_id: str, class_name: str, config: dict) -> PublishedReward:
    return PublishedReward(name, "vlm", hub_id, (("transformers", class_name, config, {}),), fp32=False)


_VISION_L14 = dict(CLIP_VIT_L14["vision_config"])
# HPSv3 (MizzenAI/HPSv3): Qwen2-VL-7B whose embeddings and lm_head were resized to its tokenizer
# with <|Reward|> added (151,657 + 1 tokens: create_model_and_processor's resize_token_embeddings),
# and its ranknet head 3584-1024-16-2 (fp32 and whole on every rank in the recipe: 15 MB, counted
# here with the model).
HPSV3_VOCAB = 151_658
HPSV3_QWEN2_VL_7B = dict(QWEN2_VL_7B, text_config=dict(QWEN2_VL_7B["text_config"], vocab_size=HPSV3_VOCAB))
HPSV3_HEAD = (3584, 1024, 16, 2)
PUBLISHED_REWARDS: dict[str, PublishedReward] = {
    r.name: r
    for r in (
        _clip("pickscore", "yuvalkirstain/PickScore_v1", CLIP_VIT_H14),
        _clip("pickscore_logit", "yuvalkirstain/PickScore_v1", CLIP_VIT_H14),
        _clip("hpsv2", "xswu/HPSv2", CLIP_VIT_H14),
        _clip("clip_score", "openai/clip-vit-large-patch14", CLIP_VIT_L14),
        _clip("clip_score_100", "openai/clip-vit-large-patch14", CLIP_VIT_L14),
        PublishedReward(
            "aesthetic",
            "aesthetic",
            "openai/clip-vit-large-patch14 + sac+logos+ava1-l14-linearMSE.pth",
            (("transformers", "CLIPVisionModelWithProjection", _VISION_L14, {}),),
            head=REWARD_HEAD,
        ),
        PublishedReward(
            "imagereward",
            "imagereward",
            "THUDM/ImageReward",
            (
                ("transformers", "BlipVisionModel", BLIP_VIT_L16, {}),
                ("transformers", "BlipTextModel", IMAGEREWARD_TEXT, {"add_pooling_layer": False}),
            ),
            head=REWARD_HEAD,
        ),
        _vlm("vlm", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_7B),
        _vlm(
            "vlm:qwen2.5-vl-7b",
            "Qwen/Qwen2.5-VL-7B-Instruct",
            "Qwen2_5_VLForConditionalGeneration",
            QWEN2_5_VL_7B,
        ),
        _vlm("vlm:qwen2-vl-7b", "Qwen/Qwen2-VL-7B-Instruct", "Qwen2VLForConditionalGeneration", QWEN2_VL_7B),
        PublishedReward(
            "hpsv3",
            "hpsv3",
            "MizzenAI/HPSv3",
            (("transformers", "Qwen2VLForConditionalGeneration", HPSV3_QWEN2_VL_7B, {}),),
            head=HPSV3_HEAD,
            fp32=False,
        ),
        PublishedReward(  # CodeGoat24/UnifiedReward-qwen-7b: a Qwen2.5-VL-7B-Instruct fine-tune
            "unifiedreward",
            "unifiedreward",
            "CodeGoat24/UnifiedReward-qwen-7b",
            (("transformers", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_7B, {}),),
            fp32=False,
        ),
        PublishedReward(  # the same judge shown whole clips (rewards.vlm_judges.UnifiedRewardVideo)
            "unifiedreward_video",
            "unifiedreward_video",
            "CodeGoat24/UnifiedReward-qwen-7b",
            (("transformers", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_7B, {}),),
            fp32=False,
        ),
        PublishedReward(  # Pref-GRPO's pairwise judge: a UnifiedReward Qwen2.5-VL-7B shown two images
            "pairwise_vlm",
            "pairwise_vlm",
            "CodeGoat24/UnifiedReward-qwen-7b",
            (("transformers", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_7B, {}),),
            fp32=False,
        ),
    )
}


def reward_placements(
    reward: PublishedReward, world_size: int, mixed_precision: str, module: torch.nn.Module | None = None
) -> dict[str, dict[str, int]]:
    """Bytes per rank of a built-in reward model by placement, in the dtype the recipe runs it
    in: ``replicate`` the whole model, ``shard`` DeepSpeed's partition (plus the parameters under
    its persistence threshold, whole), ``offload`` nothing on the device (the shard in host
    memory). No ``cache``: it scores fresh samples every round. ``module``: its
    ``meta_module()`` already built."""
    module = reward.meta_module() if module is None else module
    dtype = reward.dtype(mixed_precision)
    shard = placement_bytes_per_rank(module, "shard", world_size, dtype)
    replicate = placement_bytes_per_rank(module, "replicate", world_size, dtype)
    return {
        "replicate": {"bytes_per_rank": replicate, "parameters": replicate},
        "shard": {"bytes_per_rank": shard, "parameters": shard},
        "offload": {"bytes_per_rank": 0, "parameters": 0, "host_bytes_per_rank": shard},
    }


# ---------------------------------------------------------------------------- the round


@dataclass
class RLOptions:
    """The RL job's round (the recipe's flags of the same names). Defaults: the references'
    rounds (flow_grpo's and DiffusionNFT's SD3 configs: 48 prompts of 24 images, 10 steps)."""

    objective: str = "grpo"
    rewards: list[str] = field(default_factory=list)  # PUBLISHED_REWARDS names
    group_size: int = 24
    prompts_per_round: int = 48
    num_inference_steps: int = 10
    guidance_scale: float = 1.0  # above 1: the empty prompts' conditioning is kept too (CFG)
    ratio_norm: bool = False  # GRPO-Guard: each step's mean is kept
    sde_window_size: int = 0  # DiffusionNFT trains the window's steps (times --timestep_fraction)
    timestep_fraction: float = 1.0
    num_inner_epochs: int = 1
    nft_decay_type: int = 1  # 0: the old policy is the trained one (no copy)

    @property
    def train_timesteps(self) -> int:
        """Trained steps per sample, as ``GRPOSettings.train_timesteps``."""
        return max(1, int((self.sde_window_size or self.num_inference_steps) * self.timestep_fraction))


def check_rl_options(rl: RLOptions, options: PlanOptions) -> None:
    """``ValueError`` for an RL option out of range or an unknown reward name."""
    if rl.objective not in OBJECTIVES:
        raise ValueError(f"--rl must be grpo or nft, got {rl.objective!r}")
    for flag, value in (
        ("--group_size", rl.group_size),
        ("--prompts_per_round", rl.prompts_per_round),
        ("--num_inference_steps", rl.num_inference_steps),
        ("--num_inner_epochs", rl.num_inner_epochs),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not 0 <= rl.sde_window_size <= rl.num_inference_steps:
        raise ValueError(f"--sde_window_size must be in [0, --num_inference_steps], got {rl.sde_window_size}")
    if not 0 < rl.timestep_fraction <= 1:
        raise ValueError(f"--timestep_fraction must be in (0, 1], got {rl.timestep_fraction}")
    for name in rl.rewards:
        if name not in PUBLISHED_REWARDS:
            raise ValueError(
                f"--reward {name!r} is not a built-in the planner sizes: {', '.join(PUBLISHED_REWARDS)}"
            )
    if len(set(rl.rewards)) != len(rl.rewards):
        raise ValueError("a --reward is given twice")
    clash = {f"reward:{n}" for n in rl.rewards} & {f"reward:{n}" for n in options.reward_models}
    if clash:
        raise ValueError(f"{', '.join(sorted(clash))}: given by both --reward and --reward_model")


def samples_per_rank(rl: RLOptions, options: PlanOptions) -> int:
    """The most samples a rank holds in a round: ``ceil(prompts x group / (N / K))`` (each
    context-parallel group of K ranks draws the same samples; ``rl.groups.samples_per_rank``)."""
    groups = options.num_processes // options.context_parallel_size
    return -(-rl.prompts_per_round * rl.group_size // groups)


def conditioning_bytes(components: dict, family, options: PlanOptions) -> int:
    """Bytes of one prompt's conditioning as the recipe keeps it: every text encoder's outputs
    (``family.encode_text`` on the meta device) at its full token length, floats in the training
    dtype and masks as they are (a batch trimmed to its longest caption holds less)."""
    from .plan import text_sequence_length

    b = resolve_dtype(options.mixed_precision, {}, None).itemsize
    total = 0
    for spec in family.text_encoders:
        comp = components.get(spec.name)
        if comp is None:
            continue
        seq = text_sequence_length(comp, spec, family, options.max_sequence_length)
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        with torch.no_grad():
            outputs = family.encode_text(spec.name, comp.meta_module(), ids)
        total += sum(t.numel() * (b if t.is_floating_point() else t.element_size()) for t in outputs.values())
    return total


def latent_shape(components: dict, family, options: PlanOptions) -> tuple[int, ...]:
    """One sample's denoiser latents (``family.sample_latent_shape``: a video family's with the
    latent frames of ``options.num_frames``)."""
    height, width = options.height or options.resolution, options.width or options.resolution
    return family.sample_latent_shape(components["vae"].config, height, width, options.num_frames)


def round_bytes(components: dict, family, options: PlanOptions, rl: RLOptions) -> dict[str, int]:
    """Bytes per rank of one round's tensors (``recipes.grpo.Round``) by field, and their sum
    ``bytes_per_rank``. ``P`` samples, ``T`` steps, ``L`` latent elements, ``E`` inner epochs,
    ``K`` trained steps; fp32 unless said: ``latents`` ``P(T+1)L``, ``log_probs`` ``PT``,
    ``means`` ``PTL`` (``--ratio_norm``), ``conditioning`` one prompt's per sample (training
    dtype), ``uncond`` the same under CFG, ``images`` ``ceil(P / K) x 3 x frames x H x W`` (a
    rank's share under context parallelism of K, until scored), ``nft_points`` ``EK(2PL + P)`` (nft), ``other`` the advantages, weights, the real
    flags (bool) and the trained steps (``EPK`` int64)."""
    p, t = samples_per_rank(rl, options), rl.num_inference_steps
    e, k = rl.num_inner_epochs, rl.train_timesteps
    latent = math.prod(latent_shape(components, family, options))
    cond = conditioning_bytes(components, family, options)
    height, width = options.height or options.resolution, options.width or options.resolution
    frames = options.num_frames if family.video else 1
    out = {
        "samples_per_rank": p,
        "latent_elements": latent,
        "latents": 4 * p * (t + 1) * latent,
        "log_probs": 4 * p * t,
        "means": 4 * p * t * latent if rl.ratio_norm else 0,
        "conditioning": p * cond,
        "uncond": p * cond if rl.guidance_scale > 1 else 0,
        # under context parallelism a rank decodes and scores its share of its group's samples
        "images": 4 * math.ceil(p / options.context_parallel_size) * 3 * frames * height * width,
        "nft_points": 4 * e * k * (2 * p * latent + p) if rl.objective == "nft" else 0,
        "other": p * (4 + 4 + 1) + 8 * e * p * k,
    }
    out["bytes_per_rank"] = sum(
        v for name, v in out.items() if name not in ("samples_per_rank", "latent_elements")
    )
    return out


def old_policy_bytes(policy_row: dict, options: PlanOptions, rl: RLOptions) -> int:
    """Bytes per rank of DiffusionNFT's old policy (``--nft_decay_type`` 1 or 2): the fp32
    average of the trained partition (``4Ψ/N``: the policy's ``optimizer`` row holds ``8Ψ/N``
    of Adam moments plus, in bf16/fp16, ``4Ψ/N`` of master weights) and the trained partition it
    swaps out while it samples (``bΨ/N``). None for GRPO or ``--nft_decay_type 0``."""
    if rl.objective != "nft" or rl.nft_decay_type == 0:
        return 0
    b = resolve_dtype(options.mixed_precision, {}, None).itemsize
    own = policy_row["gradients"] // b  # the trained elements of this rank's partition
    return 4 * own + b * own


# ---------------------------------------------------------------------------- the plan


def make_rl_plan(pipeline: str, options: PlanOptions, rl: RLOptions) -> dict:
    """The RL job's plan as a JSON-ready dict: the plain plan's keys (components with each
    ``reward:NAME``, ``recommended``, ``total_bytes_per_rank`` and ``fits`` now with the round
    and the old policy in) and ``rl``: the round's bytes by field, the old policy's, the fixed
    bytes, and ``combinations``: every placement of the reference and the rewards with the
    others' recommended placements, its total per rank and whether it fits."""
    check_rl_options(rl, options)
    options = replace(options, fixed_data=False)  # nothing is cached: every round's samples are new
    family, components = job_components(pipeline, options)
    modules = {name: PUBLISHED_REWARDS[name].meta_module() for name in rl.rewards}
    rows, round_, old = _rl_rows(components, family, options, rl, modules)
    fixed = round_["bytes_per_rank"] + old
    chosen = _recommend_with(rows, options, fixed, options.fixed_placements)
    rl_models = [n for n in rows if n == "reference" or n.startswith("reward:")]
    choices = [p for p in RL_MODEL_PLACEMENTS if p != "offload" or options.offload in ("frozen", "all")]
    combinations = []
    for placed in itertools.product(choices, repeat=len(rl_models)):
        fixed_placements = {**options.fixed_placements, **dict(zip(rl_models, placed))}
        result = _recommend_with(rows, options, fixed, fixed_placements)
        combinations.append({"placements": dict(zip(rl_models, placed)), **result})
    plan = {
        "pipeline": str(pipeline),
        "pipeline_class": family.pipeline_class,
        "num_processes": options.num_processes,
        "components": rows,
        **chosen,
        "notes": plan_notes(str(pipeline), components, family),
        "rl": {
            "objective": rl.objective,
            "policy": "lora" if options.rank else "full",
            "reference": _reference_words(rows, options),
            "group_size": rl.group_size,
            "prompts_per_round": rl.prompts_per_round,
            "num_inference_steps": rl.num_inference_steps,
            "round": round_,
            "old_policy_bytes_per_rank": old,
            "fixed_bytes_per_rank": fixed,
            "combinations": combinations,
            "recipe_flags": recipe_flags(chosen["recommended"], family.denoiser),
        },
    }
    if not plan["fits"]:
        plan["advice"] = _rl_advice(components, family, options, rl, modules)
    return plan


def _rl_rows(components: dict, family, options: PlanOptions, rl: RLOptions, modules: dict) -> tuple:
    """``(rows, round, old policy bytes)``: the plan's component rows (no cache rows: the recipe
    places its frozen models live) with each reward's, the round's bytes by field and the old
    policy's bytes per rank. ``modules``: each reward's meta module."""
    rows = _plan(components, family, options)["components"]
    for row in rows.values():
        row["placements"].pop("cache", None)
    for name in rl.rewards:
        reward = PUBLISHED_REWARDS[name]
        rows[f"reward:{name}"] = {
            "class": reward.class_name,
            "parameters": sum(p.numel() for p in modules[name].parameters()),
            "trainable": False,
            "placements": reward_placements(
                reward, options.num_processes, options.mixed_precision, modules[name]
            ),
            "cacheable": False,
            "dtype": str(reward.dtype(options.mixed_precision)).removeprefix("torch."),
            "hub_id": reward.hub_id,
        }
    round_ = round_bytes(components, family, options, rl)
    old = old_policy_bytes(rows[family.denoiser]["placements"]["shard"], options, rl)
    return rows, round_, old


def _rl_advice(components: dict, family, options: PlanOptions, rl: RLOptions, modules: dict) -> list[str]:
    """Sentences naming changes that would make the RL job fit, each checked by planning again:
    more processes (the round's samples spread too), LoRA, ``--offload all``."""
    advice = []
    n = options.num_processes
    while n < 1024:
        n *= 2
        if _rl_fits(components, family, replace(options, num_processes=n), rl, modules):
            advice.append(f"it would fit on {n} processes (--num_processes {n})")
            break
    else:
        advice.append("it does not fit on up to 1024 processes")
    for text, change in (
        ("with --offload all (frozen shards and the optimizer in host memory)", {"offload": "all"}),
        ("with LoRA (--rank 64)", {"rank": 64}),
    ):
        if any(getattr(options, k) == v for k, v in change.items()) or ("rank" in change and options.rank):
            continue
        if _rl_fits(components, family, replace(options, **change), rl, modules):
            advice.append(f"it would fit at --num_processes {options.num_processes} {text}")
    return advice


def _rl_fits(components: dict, family, options: PlanOptions, rl: RLOptions, modules: dict) -> bool:
    rows, round_, old = _rl_rows(components, family, options, rl, modules)
    return _recommend_with(rows, options, round_["bytes_per_rank"] + old, options.fixed_placements)["fits"]


def _recommend_with(rows: dict, options: PlanOptions, fixed: int, fixed_placements: dict[str, str]) -> dict:
    """``recommend`` for the models in what ``fixed`` bytes (the round, the old policy) leave of
    the budget, with ``fixed_placements`` kept; the totals include ``fixed``."""
    budget = None if options.device_memory is None else int(options.device_memory * (1 - options.margin))
    if budget is None:
        states = recommend(rows, replace(options, fixed_placements=fixed_placements))
    else:
        # the device memory the models may use, so that recommend's own margin leaves the same budget
        left = max(0, budget - fixed) / (1 - options.margin)
        states = recommend(rows, replace(options, device_memory=int(left), fixed_placements=fixed_placements))
    total = states["total_bytes_per_rank"] + fixed
    out = {
        "recommended": states["recommended"],
        "state_bytes_per_rank": states["total_bytes_per_rank"],
        "total_bytes_per_rank": total,
        "fits": budget is None or total <= budget,
    }
    if budget is not None:
        out["budget_bytes_per_rank"] = budget
    return out


def recipe_flags(recommended: dict[str, str], denoiser: str) -> list[str]:
    """``train_grpo.py``'s placement flags of the frozen models of ``recommended`` (the trained
    denoiser's offload is DeepSpeed's config, not a flag), e.g. ``["--vae_placement replicate",
    "--reward_placement vlm=shard"]``."""
    flags = []
    for name, placement in recommended.items():
        if name == denoiser:
            continue
        if name.startswith("reward:"):
            reward = name.removeprefix("reward:")
            builtin = PUBLISHED_REWARDS[reward].builtin if reward in PUBLISHED_REWARDS else reward
            flags.append(f"--reward_placement {builtin}={placement}")
        else:
            flags.append(f"--{name}_placement {placement}")
    return flags


def _reference_words(rows: dict, options: PlanOptions) -> str:
    if not options.reference:
        return "none (--reference not given: no KL to a reference)"
    if options.rank:
        return "the base with the adapters disabled (no bytes)"
    return "a frozen copy of the denoiser (reference)"


# ---------------------------------------------------------------------------- the command line


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    """The RL mode's flags of ``diffusers-zero3-plan``."""
    g = p.add_argument_group("RL (--rl): the round, the rewards, the placements that fit")
    g.add_argument("--rl", choices=OBJECTIVES, default=None, help="plan an RL job of this objective")
    g.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME",
        help="a built-in reward sized from its published config (NAME=WEIGHT as the recipe takes it too); "
        "repeatable: " + ", ".join(PUBLISHED_REWARDS),
    )
    g.add_argument(
        "--group_size", type=int, default=RLOptions.group_size, help="images per prompt in a round"
    )
    g.add_argument("--prompts_per_round", type=int, default=RLOptions.prompts_per_round)
    g.add_argument("--num_inference_steps", type=int, default=RLOptions.num_inference_steps)
    g.add_argument(
        "--guidance_scale", type=float, default=1.0, help="above 1: CFG's empty prompts are kept too"
    )
    g.add_argument("--ratio_norm", action="store_true", help="GRPO-Guard: each step's mean is kept")
    g.add_argument("--sde_window_size", type=int, default=0, help="nft: the trained steps are the window's")
    g.add_argument("--timestep_fraction", type=float, default=1.0)
    g.add_argument("--num_inner_epochs", type=int, default=1)
    g.add_argument("--nft_decay_type", type=int, default=1, choices=(0, 1, 2), help="0: no old-policy copy")


def rl_options_from_args(args: argparse.Namespace) -> RLOptions | None:
    """``RLOptions`` of the parsed command line; None without ``--rl`` (``ValueError`` for a
    ``--reward`` without it)."""
    if args.rl is None:
        if args.reward:
            raise ValueError("--reward plans a built-in reward of an RL job: give --rl grpo or --rl nft")
        return None
    return RLOptions(
        objective=args.rl,
        rewards=[spec.partition("=")[0] for spec in args.reward],  # the recipe's NAME=WEIGHT too
        group_size=args.group_size,
        prompts_per_round=args.prompts_per_round,
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        ratio_norm=args.ratio_norm,
        sde_window_size=args.sde_window_size,
        timestep_fraction=args.timestep_fraction,
        num_inner_epochs=args.num_inner_epochs,
        nft_decay_type=args.nft_decay_type,
    )


def format_rl_table(plan: dict) -> str:
    """The RL plan as text: the planner's table (the rewards' rows in it), the round's bytes by
    field, the old policy, then one line per combination of the RL models' placements."""
    rl = plan["rl"]
    lines = [format_table(plan)]
    r = rl["round"]
    fields = ("latents", "log_probs", "means", "conditioning", "uncond", "images", "nft_points", "other")
    lines.append(
        f"{rl['objective']} round: {rl['prompts_per_round']} prompts x {rl['group_size']} images, "
        f"{rl['num_inference_steps']} steps; {r['samples_per_rank']} samples per rank: "
        + ", ".join(f"{f} {_size(r[f])}" for f in fields if r[f])
        + f"; {r['bytes_per_rank'] / GIB:.2f} GiB per rank"
    )
    if rl["old_policy_bytes_per_rank"]:
        lines.append(
            f"nft old policy (fp32 average + swapped partition): {rl['old_policy_bytes_per_rank'] / GIB:.2f} GiB"
        )
    lines.append(f"policy: {rl['policy']}; reference: {rl['reference']}")
    if plan["fits"] and rl["recipe_flags"]:
        lines.append("train_grpo.py placements: " + " ".join(rl["recipe_flags"]))
    combos = rl["combinations"]
    if combos and combos[0]["placements"]:
        names = list(combos[0]["placements"])
        width = max(10, *(len(n) for n in names))
        lines.append(" ".join(f"{n:<{width}}" for n in names) + f" {'total GiB':>10}  fits  others")
        for c in combos:
            others = ", ".join(f"{n}={p}" for n, p in c["recommended"].items() if n not in c["placements"])
            lines.append(
                " ".join(f"{c['placements'][n]:<{width}}" for n in names)
                + f" {c['total_bytes_per_rank'] / GIB:>10.2f}  {'yes' if c['fits'] else 'no ':<4}  {others}"
            )
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"
