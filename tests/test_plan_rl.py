"""The planner's RL mode (``diffusers-zero3-plan --rl grpo|nft``, ``placement.rl_plan``): the
built-in rewards at their published sizes, the round's bytes per rank against a hand count on
the tiny pipeline, DiffusionNFT's old policy, and the placements that fit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from diffusers_zero3.placement.plan import PlanOptions, main
from diffusers_zero3.placement.rl_plan import (
    PUBLISHED_REWARDS,
    PublishedReward,
    RLOptions,
    make_rl_plan,
    reward_placements,
)

GIB = 2**30

# Parameter counts of the published reward models (model cards and hub metadata)
PUBLISHED_PARAMETERS = {
    # CLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, "986M"), which PickScore_v1 and
    # HPSv2 fine-tune: vision tower, text tower, both projections and the logit scale
    "pickscore": 986_109_441,
    "pickscore_logit": 986_109_441,
    "hpsv2": 986_109_441,
    # openai/clip-vit-large-patch14 ("428M")
    "clip_score": 427_616_513,
    "clip_score_100": 427_616_513,
    # Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen2-VL-7B-Instruct ("8.29B" each, vision towers and
    # lm_head included; the first is also Qwen-Image's text encoder, tests/test_plan.py)
    "vlm": 8_292_166_656,
    "vlm:qwen2.5-vl-7b": 8_292_166_656,
    "vlm:qwen2-vl-7b": 8_291_375_616,
    # MizzenAI/HPSv3: Qwen2-VL-7B with 406 fewer tokens (its vocabulary resized to 151,658:
    # Qwen2-VL's tokenizer and <|Reward|>) in the embeddings and lm_head (3584 wide each), and its
    # head 3584-1024-16-2 (3,687,474)
    "hpsv3": 8_291_375_616 - 406 * 3584 * 2 + 3_687_474,
    # CodeGoat24/UnifiedReward-qwen-7b: a Qwen2.5-VL-7B-Instruct fine-tune
    "unifiedreward": 8_292_166_656,
    # the same judge shown whole clips
    "unifiedreward_video": 8_292_166_656,
    # Pref-GRPO's pairwise judge on the same model
    "pairwise_vlm": 8_292_166_656,
    # THUDM/ImageReward: BLIP's ViT-L/16 at 224 (303,301,632), the BERT-base text encoder with a
    # cross-attention in each of its 12 layers and no pooler (141,977,088), the MLP head
    # 768-1024-128-64-16-1 (927,969): 446 M (BLIP's contrastive projections are not loaded)
    "imagereward": 303_301_632 + 141_977_088 + 927_969,
    # LAION's aesthetic predictor: CLIP ViT-L/14's vision tower with its projection
    # (303,966,976 + 1024 x 768) and the same head
    "aesthetic": 303_179_776 + 1024 * 768 + 927_969,
}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(PUBLISHED_REWARDS))
def test_built_in_rewards_have_their_published_parameter_counts(name):
    module = PUBLISHED_REWARDS[name].meta_module()
    assert all(p.device.type == "meta" for p in module.parameters())  # nothing loaded
    assert sum(p.numel() for p in module.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.mark.unit
def test_every_planned_reward_is_a_recipe_built_in_in_its_dtype():
    """Each name sizes a ``--reward`` built-in of the recipe, held in the dtype the recipe runs it
    in (fp32 for the CLIP and BLIP scorers, the run's for the VLM judge), and the default names
    size the built-in's published weights; HPSv2's loader builds the same CLIP config."""
    from transformers import CLIPModel

    from diffusers_zero3.rewards.builtin import BUILTINS
    from diffusers_zero3.rewards.hps import vit_h14_config

    for name, reward in PUBLISHED_REWARDS.items():
        builtin = BUILTINS[reward.builtin]
        assert reward.fp32 == (builtin.dtype == torch.float32), name
        if name == reward.builtin and name not in (
            "aesthetic",
            "hpsv3",
            "pairwise_vlm",
        ):  # folder descriptions
            assert reward.hub_id == builtin.published, name
    with torch.device("meta"):
        hps = CLIPModel(vit_h14_config())
    assert sum(p.numel() for p in hps.parameters()) == PUBLISHED_PARAMETERS["hpsv2"]


@pytest.mark.unit
def test_reward_rows_are_bytes_in_the_recipe_dtype():
    """In a bf16 run PickScore stays fp32 (4 bytes a parameter) and the judge is bf16 (2); a
    sharded model holds ceil(n / N) of each parameter plus the whole of those under the
    persistence threshold (640 elements for this head: all of them)."""
    head = PublishedReward("head", "pickscore", "x", (), head=(4, 3, 1))  # 4*3+3 + 3*1+1 = 19
    rows = reward_placements(head, 2, "bf16")
    assert rows["replicate"]["bytes_per_rank"] == 4 * 19
    assert rows["shard"]["bytes_per_rank"] == 4 * ((6 + 12) + (2 + 3) + (2 + 3) + (1 + 1))
    assert rows["offload"] == {"bytes_per_rank": 0, "parameters": 0, "host_bytes_per_rank": 4 * 30}
    judge = replace(head, fp32=False)
    assert reward_placements(judge, 2, "bf16")["replicate"]["bytes_per_rank"] == 2 * 19
    assert reward_placements(judge, 2, "no")["replicate"]["bytes_per_rank"] == 4 * 19


@pytest.mark.unit
def test_the_round_is_counted_field_by_field(tiny_pipeline):
    """The tiny SD pipeline at 16 px: latents 4 x 8 x 8 = 256 elements, CLIP outputs 77 x 32.
    3 prompts x 3 images over 2 ranks: 5 samples on the fuller rank; 4 steps, nft with a window of
    2 (2 trained steps) and 2 inner epochs, CFG and --ratio_norm; fp32 run."""
    rl = RLOptions(
        objective="nft",
        group_size=3,
        prompts_per_round=3,
        num_inference_steps=4,
        guidance_scale=4.5,
        ratio_norm=True,
        sde_window_size=2,
        num_inner_epochs=2,
    )
    options = PlanOptions(num_processes=2, resolution=16)
    r = make_rl_plan(tiny_pipeline, options, rl)["rl"]["round"]
    p, t, latent, e, k = 5, 4, 256, 2, 2
    expected = {
        "latents": 4 * p * (t + 1) * latent,  # fp32, every step's state and the clean latents
        "log_probs": 4 * p * t,
        "means": 4 * p * t * latent,
        "conditioning": p * 77 * 32 * 4,
        "uncond": p * 77 * 32 * 4,
        "images": 4 * p * 3 * 16 * 16,
        "nft_points": 4 * e * k * (2 * p * latent + p),  # x_t, v_old and sigma
        "other": p * (4 + 4 + 1) + 8 * e * p * k,
    }
    assert r["samples_per_rank"] == p and r["latent_elements"] == latent
    assert {f: r[f] for f in expected} == expected
    assert r["bytes_per_rank"] == sum(expected.values()) == 201_325
    # GRPO without CFG or --ratio_norm keeps neither the means, the empty prompts nor nft's points
    plain = make_rl_plan(
        tiny_pipeline, options, replace(rl, objective="grpo", guidance_scale=1, ratio_norm=False)
    )
    r = plain["rl"]["round"]
    assert r["means"] == r["uncond"] == r["nft_points"] == 0
    assert r["latents"] == expected["latents"] and r["images"] == expected["images"]


@pytest.mark.unit
def test_a_context_parallel_group_decodes_its_share_of_the_clips(tiny_wan22_5b):
    """Wan 2.2 TI2V-5B clips of 5 frames at 32 px, 3 prompts x 3 on 2 ranks: at K=1 a rank holds
    5 samples and their 5 clips; at K=2 the group's 9 samples (each rank samples them all) and
    its share of the clips, 5 (``GRPOTrainer._decode_share``)."""
    rl = RLOptions(group_size=3, prompts_per_round=3, num_inference_steps=4)
    clip = 4 * 3 * 5 * 32 * 32
    for size, samples, clips in ((1, 5, 5), (2, 9, 5)):
        options = PlanOptions(num_processes=2, resolution=32, num_frames=5, context_parallel_size=size)
        r = make_rl_plan(tiny_wan22_5b, options, rl)["rl"]["round"]
        assert r["samples_per_rank"] == samples and r["images"] == clips * clip, (size, r)


@pytest.mark.unit
def test_nft_old_policy_and_the_reference_full_and_lora(tiny_pipeline):
    """DiffusionNFT's old policy: an fp32 average of this rank's partition and the bf16 partition
    it swaps out, 6 bytes per trained element (the adapters' under LoRA); none for GRPO or
    --nft_decay_type 0. The reference: a frozen copy for full fine-tuning, none under LoRA."""
    options = PlanOptions(num_processes=2, resolution=16, mixed_precision="bf16", reference=True)
    rl = RLOptions(group_size=2, prompts_per_round=2, num_inference_steps=2)
    nft = make_rl_plan(tiny_pipeline, options, replace(rl, objective="nft"))
    unet = nft["components"]["unet"]["parameters"]
    assert nft["rl"]["old_policy_bytes_per_rank"] == 6 * -(-unet // 2)
    assert nft["rl"]["fixed_bytes_per_rank"] == nft["rl"]["round"]["bytes_per_rank"] + 6 * -(-unet // 2)
    assert make_rl_plan(tiny_pipeline, options, rl)["rl"]["old_policy_bytes_per_rank"] == 0
    no_copy = make_rl_plan(tiny_pipeline, options, replace(rl, objective="nft", nft_decay_type=0))
    assert no_copy["rl"]["old_policy_bytes_per_rank"] == 0
    assert nft["components"]["reference"]["parameters"] == unet
    assert {c for combo in nft["rl"]["combinations"] for c in combo["placements"]} == {"reference"}
    lora = make_rl_plan(tiny_pipeline, replace(options, rank=4), replace(rl, objective="nft"))
    adapters = lora["components"]["unet"]["placements"]["shard"]["gradients"] // 2
    assert lora["rl"]["old_policy_bytes_per_rank"] == 6 * adapters > 0
    assert "reference" not in lora["components"] and lora["rl"]["policy"] == "lora"
    assert "adapters disabled" in lora["rl"]["reference"]


@pytest.mark.unit
def test_the_combinations_say_which_placements_fit(tiny_pipeline):
    """PickScore at its published size beside the tiny pipeline on 8 ranks of 4 GiB (3 GiB usable):
    replicated it is 3.67 GiB in fp32 and does not fit, sharded (0.47 GiB) it does; each
    combination's total is its models plus the round, and the recommendation is the fitting one."""
    options = PlanOptions(num_processes=8, resolution=16, device_memory=4 * GIB)
    rl = RLOptions(rewards=["pickscore"], group_size=4, prompts_per_round=8, num_inference_steps=2)
    plan = make_rl_plan(tiny_pipeline, options, rl)
    rows = plan["components"]["reward:pickscore"]
    assert rows["dtype"] == "float32" and set(rows["placements"]) == {"replicate", "shard", "offload"}
    assert rows["placements"]["replicate"]["bytes_per_rank"] == 4 * 986_109_441
    combos = {c["placements"]["reward:pickscore"]: c for c in plan["rl"]["combinations"]}
    assert set(combos) == {"replicate", "shard"}  # offload only with --offload frozen or all
    fixed = plan["rl"]["fixed_bytes_per_rank"]
    for combo in combos.values():
        models = sum(
            plan["components"][n]["placements"][p]["bytes_per_rank"] for n, p in combo["recommended"].items()
        )
        assert combo["total_bytes_per_rank"] == models + fixed
        assert combo["fits"] == (combo["total_bytes_per_rank"] <= 3 * GIB)
    assert not combos["replicate"]["fits"] and combos["shard"]["fits"]
    assert plan["recommended"]["reward:pickscore"] == "shard" and plan["fits"]
    assert "--reward_placement pickscore=shard" in plan["rl"]["recipe_flags"]
    assert "--vae_placement replicate" in plan["rl"]["recipe_flags"]
    # the round counts against the budget: enough samples and even the sharded one does not fit
    crowded = make_rl_plan(
        tiny_pipeline, replace(options, resolution=256), replace(rl, prompts_per_round=8192)
    )
    assert crowded["rl"]["round"]["bytes_per_rank"] > 3 * GIB and not crowded["fits"]
    assert not any(c["fits"] for c in crowded["rl"]["combinations"])
    # more ranks spread the round's samples too: the advice is checked by planning again
    assert any(a.startswith("it would fit on ") for a in crowded["advice"]), crowded["advice"]
    allowed = make_rl_plan(tiny_pipeline, replace(options, offload="frozen"), rl)
    assert {c["placements"]["reward:pickscore"] for c in allowed["rl"]["combinations"]} == {
        "replicate",
        "shard",
        "offload",
    }


@pytest.mark.unit
def test_command_line_rl_mode_and_bad_input(capsys, tiny_pipeline):
    argv = [tiny_pipeline, "--num_processes", "2", "--resolution", "16", "--rl", "grpo", "--group_size", "2"]
    assert main([*argv, "--prompts_per_round", "2", "--num_inference_steps", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rl"]["round"]["samples_per_rank"] == 2 and printed["rl"]["objective"] == "grpo"
    assert (
        main([*argv, "--prompts_per_round", "2", "--reward", "pickscore=1.0", "--device_memory", "8GiB"]) == 0
    )
    out = capsys.readouterr().out
    assert "grpo round: 2 prompts x 2 images" in out and "reward:pickscore" in out and "fits" in out
    assert "train_grpo.py placements: " in out and "--reward_placement pickscore=" in out
    for bad, words in [
        ([*argv, "--reward", "pickscor"], "not a built-in the planner sizes"),
        ([tiny_pipeline, "--reward", "pickscore"], "give --rl grpo or --rl nft"),
        ([*argv, "--reward", "vlm", "--reward", "vlm"], "given twice"),
        ([*argv, "--prompts_per_round", "0"], "--prompts_per_round must be at least 1"),
    ]:
        assert main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


@pytest.mark.unit
def test_the_documented_rl_plans_are_the_benchmark_jobs():
    """docs/rl.md's RL plans are generated (``python -m benchmarks.bench_plan_rl --rl-md``; its
    ``--check`` replans them all): the commands printed are the jobs', one table row each."""
    from benchmarks.bench_plan_rl import RL_JOBS, RL_MD, commands_block, documented_section

    documented = documented_section(RL_MD.read_text())
    assert documented.startswith(commands_block() + "\n")
    rows = [line for line in documented.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(RL_JOBS)  # the header and a row per job
    with pytest.raises(ValueError, match="no RL plans"):
        documented_section("# no markers\n")
