"""Group-wise rewards (``rewards.groupwise``) and the pairwise VLM judge (``rewards.pairwise_judge``).

* The win rate is Pref-GRPO's (``fastvideo/rewards/unifiedreward_think.py``, ``_pairwise_win_rate``,
  transcribed below) for hard answers in its single order.
* On 2 ranks (DeepSpeed ZeRO-3, gloo) with unequal real samples per rank (zero included), every
  sample's group-wise score equals the score of its whole group on one process; scoring each
  rank's members alone (no gather) gives other numbers (the positive control); a sharded
  ``pairwise_vlm`` judge makes the same forwards on every rank (lockstep check) and gives the
  one-process scores.
* The judge built tiny from a config equals a transcription of its computation with Qwen2-VL's
  processor, pair by pair, both orders averaged.
* A GRPO round on 2 ranks with a group-wise reward: the advantages are those of redness plus the
  group-wise score of each whole group.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from diffusers_zero3.rewards.groupwise import judges_pairs, scores_groups
from tests.distributed_harness import run_on_ranks
from tests.test_reward_registry import _as_tensor, _pil, _uint8_images

SELF = "tests.test_group_rewards"
REDNESS = "diffusers_zero3.demo.rewards:redness"
CPU = torch.device("cpu")


@scores_groups
def above_group_mean(images, prompts):
    """Each image's brightness minus its group's mean brightness: depends on the members seen."""
    b = images.mean((1, 2, 3))
    return b - b.mean()


@judges_pairs
def brighter(pairs, prompts):
    """P(first brighter), with a preference for the first position (+0.7 in the logit)."""
    b = pairs.mean((2, 3, 4))
    return torch.sigmoid(20 * (b[:, 0] - b[:, 1]) + 0.7)


# ------------------------------------------------------------------ the reference, transcribed


def _reference_win_rate(num_items: int, responses: list[dict]) -> list[float]:
    """Pref-GRPO's ``_pairwise_win_rate`` (unifiedreward_think.py), without its rounding to 3
    decimals: the winner named in the answer gets 1, both 0.5 when it names neither; wins over
    comparisons, 0 with none."""
    win, compare = defaultdict(float), defaultdict(int)
    for result in responses:
        i, j = result["first_index"], result["second_index"]
        compare[i] += 1
        compare[j] += 1
        answer = result["answer"]
        if answer and "Image 1 is better" in answer:
            win[i] += 1
        elif answer and "Image 2 is better" in answer:
            win[j] += 1
        else:
            win[i] += 0.5
            win[j] += 0.5
    return [win[i] / compare[i] if compare[i] > 0 else 0.0 for i in range(num_items)]


@pytest.mark.unit
def test_win_rates_are_pref_grpos_for_hard_answers_in_its_order():
    from diffusers_zero3.rewards.groupwise import ordered_pairs, win_rates

    answers = ["Image 1 is better", "Image 2 is better", "a tie", None]
    gen = torch.Generator(device=CPU).manual_seed(0)
    for n in (1, 2, 3, 5):
        pairs = list(itertools.combinations(range(n), 2))
        assert ordered_pairs([list(range(n))], both_orders=False) == pairs
        picks = torch.randint(0, len(answers), (len(pairs),), generator=gen, device=CPU).tolist()
        responses = [
            {"first_index": i, "second_index": j, "answer": answers[k]} for (i, j), k in zip(pairs, picks)
        ]
        prefs = torch.tensor([{0: 1.0, 1: 0.0}.get(k, 0.5) for k in picks], dtype=torch.float64, device=CPU)
        got = win_rates(n, pairs, prefs)
        torch.testing.assert_close(got, torch.tensor(_reference_win_rate(n, responses), dtype=torch.float64))


@pytest.mark.unit
def test_dealing_gives_every_rank_the_same_count_and_covers_each_item_once():
    from diffusers_zero3.rewards.groupwise import deal

    for count in range(0, 12):
        for world in (1, 2, 3, 4):
            shares = [deal(count, world, r) for r in range(world)]
            assert len({len(items) for items, _ in shares}) == 1  # the same number of calls everywhere
            real = [i for items, keep in shares for i, k in zip(items, keep) if k]
            assert real == list(range(count))


@pytest.mark.unit
def test_both_orders_cancel_a_judges_position_preference():
    """A judge that only prefers the first position gives every member 0.5 with both orders; in
    the reference's single order the lower-indexed members win more."""
    from diffusers_zero3.rewards.groupwise import ordered_pairs, win_rates

    pairs = ordered_pairs([[0, 1, 2, 3]])
    torch.testing.assert_close(
        win_rates(4, pairs, torch.full((len(pairs),), 0.8, device=CPU)),
        torch.full((4,), 0.5, dtype=torch.float64),
    )
    one = ordered_pairs([[0, 1, 2, 3]], both_orders=False)
    assert win_rates(4, one, torch.full((len(one),), 0.8, device=CPU)).tolist() == pytest.approx(
        [0.8, 0.6, 0.4, 0.2]
    )


@pytest.mark.unit
def test_a_spec_takes_the_scope_its_function_or_builtin_declares():
    from diffusers_zero3.errors import ArgumentError
    from diffusers_zero3.rewards import parse_reward_specs

    specs = parse_reward_specs(
        [f"{SELF}:above_group_mean", f"{SELF}:brighter", REDNESS, "pairwise_vlm"], ["pairwise_vlm=/w"]
    )
    assert [s.scope for s in specs] == ["group", "pairwise", "sample", "pairwise"]
    assert [s.is_groupwise for s in specs] == [True, True, False, True]
    with pytest.raises(ArgumentError, match="reward_scope 'pairs'"):
        parse_reward_specs([f"{SELF}:bad_scope"])


def bad_scope(images, prompts):
    return images.mean((1, 2, 3))


bad_scope.reward_scope = "pairs"


# ------------------------------------------------------------------ 2 ranks

# 3 groups of 4 and a group of 1, in a shuffled order (groups straddle the ranks)
KEYS = [(g, m) for g in range(3) for m in range(4)] + [(7, 0)]
ORDER = [5, 0, 9, 12, 3, 11, 1, 7, 2, 10, 4, 8, 6]


def _one_process_scores(images: torch.Tensor, keys: list[tuple[int, int]] = KEYS) -> dict[str, torch.Tensor]:
    """Each sample of ``keys`` scored with its whole group, without a process group."""
    from diffusers_zero3.placement.rewards import ParallelReward
    from diffusers_zero3.rewards.groupwise import GroupwiseReward, SampleGroups, ordered_pairs, win_rates

    groups = SampleGroups([g for g, _ in keys], [m for _, m in keys], [True] * len(keys))
    prompts = [f"prompt {g}" for g, _ in keys]
    out = {
        name: GroupwiseReward(ParallelReward(fn), scope)(images, prompts, groups)
        for name, fn, scope in (("group", above_group_mean, "group"), ("pairwise", brighter, "pairwise"))
    }
    # the same, written out: a group's brightness against its mean; win rates over both orders
    b = images.mean((1, 2, 3)).double()
    by_group = defaultdict(list)
    for i, (g, _) in enumerate(keys):
        by_group[g].append(i)
    want = torch.zeros(len(keys), dtype=torch.float64, device=CPU)
    for rows in by_group.values():
        want[rows] = b[rows] - b[rows].mean()
    torch.testing.assert_close(out["group"].double(), want, rtol=1e-6, atol=1e-7)
    pairs = ordered_pairs(list(by_group.values()))
    prefs = brighter(torch.stack([images[[i for i, _ in pairs]], images[[j for _, j in pairs]]], 1), None)
    torch.testing.assert_close(out["pairwise"].double(), win_rates(len(keys), pairs, prefs).float().double())
    return out


def _shares(counts: tuple[int, int], rank: int) -> tuple[list[int], int]:
    """This rank's real samples (indices into KEYS, in ORDER) and its padded length."""
    start = sum(counts[:rank])
    return ORDER[start : start + counts[rank]], max(counts) + 1


def worker_groupwise(ref_path: str, judge_folder: str):
    import torch.distributed as dist

    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from diffusers_zero3.rewards.groupwise import SampleGroups, win_rates
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3(zero3_init_flag=False)
    rank = dist.get_rank()
    ref = torch.load(ref_path)
    images = ref["images"]
    specs = parse_reward_specs([f"{SELF}:above_group_mean", f"{SELF}:brighter=0.5", REDNESS])
    rewards = load_rewards(specs, accelerator, torch.float32)
    assert rewards.groupwise == [f"{SELF}:above_group_mean", f"{SELF}:brighter"]
    for counts in ((9, 4), (13, 0), (2, 11)):
        mine, length = _shares(counts, rank)
        rows = mine + [mine[-1] if mine else 0] * (length - len(mine))  # dummies: copies, as the trainer's
        real = [True] * len(mine) + [False] * (length - len(mine))
        groups = SampleGroups([KEYS[i][0] for i in rows], [KEYS[i][1] for i in rows], real)
        prompts = [f"prompt {KEYS[i][0]}" for i in rows]
        with rewards.lockstep_check():
            total, scores = rewards(images[rows], prompts, groups=groups)
        got_group = scores[f"{SELF}:above_group_mean"]
        got_pair = scores[f"{SELF}:brighter"]
        n = len(mine)
        torch.testing.assert_close(got_group[:n], ref["group"][mine], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got_pair[:n], ref["pairwise"][mine], rtol=1e-6, atol=1e-7)
        assert (got_group[n:] == 0).all() and (got_pair[n:] == 0).all()
        assert total.shape == (length,)

        # positive control: each rank's members of a group alone (no gather) score otherwise
        alone_group = torch.zeros(n, device=CPU)
        by_group = defaultdict(list)
        for k, i in enumerate(mine):
            by_group[KEYS[i][0]].append(k)
        pairs = []
        for ks in by_group.values():
            alone_group[ks] = above_group_mean(images[[mine[k] for k in ks]], None)
            pairs += [(a, b) for a in ks for b in ks if a != b]
        alone_pair = torch.zeros(n, dtype=torch.float64, device=CPU)
        if pairs:
            prefs = brighter(
                torch.stack([images[[mine[a] for a, _ in pairs]], images[[mine[b] for _, b in pairs]]], 1),
                None,
            )
            alone_pair = win_rates(n, pairs, prefs)
        if counts[rank] not in (0, len(KEYS)):  # a rank holding part of a group
            assert not torch.allclose(alone_group, ref["group"][mine], atol=1e-4)
            assert not torch.allclose(alone_pair.float(), ref["pairwise"][mine], atol=1e-4)

    # context parallelism: both ranks hold the same samples (each sample is scored once)
    rows = ORDER[:7]
    groups = SampleGroups([KEYS[i][0] for i in rows], [KEYS[i][1] for i in rows], [True] * len(rows))
    _, scores = rewards(images[rows], [f"prompt {KEYS[i][0]}" for i in rows], groups=groups)
    subset = torch.tensor(rows, device=CPU)
    want = _one_process_scores(images[subset], [KEYS[i] for i in rows])
    torch.testing.assert_close(scores[f"{SELF}:brighter"], want["pairwise"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scores[f"{SELF}:above_group_mean"], want["group"], rtol=1e-6, atol=1e-7)

    # a sharded pairwise_vlm judge: the same forwards on every rank, the one-process scores
    specs = parse_reward_specs(["pairwise_vlm"], [f"pairwise_vlm={judge_folder}"])
    judge = load_rewards(specs, accelerator, torch.float32, micro_batch_size=2)
    assert judge.rewards["pairwise_vlm"].model.is_sharded
    small = ref["judge_images"]
    judge_keys = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for shares in (([0, 3, 1], [4, 2]), ([], [0, 1, 2, 3, 4])):
        mine = shares[rank]
        length = 5
        rows = mine + [0] * (length - len(mine))
        real = [True] * len(mine) + [False] * (length - len(mine))
        groups = SampleGroups([judge_keys[i][0] for i in rows], [judge_keys[i][1] for i in rows], real)
        with judge.lockstep_check():
            _, scores = judge(small[rows], [f"prompt {judge_keys[i][0]}" for i in rows], groups=groups)
        torch.testing.assert_close(
            scores["pairwise_vlm"][: len(mine)], ref["judge"][mine], rtol=1e-5, atol=1e-6
        )
    print("OK groupwise")


@pytest.mark.multirank
def test_groupwise_rewards_on_two_ranks_equal_whole_groups_on_one_process(judge_folder, tmp_path):
    gen = torch.Generator(device=CPU).manual_seed(4)
    images = torch.rand(len(KEYS), 3, 8, 8, generator=gen, device=CPU)
    ref = _one_process_scores(images)
    small = _as_tensor(_uint8_images(5, 28, 28, seed=2))
    judge_keys = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    from diffusers_zero3.placement.rewards import ParallelReward
    from diffusers_zero3.rewards.groupwise import GroupwiseReward, SampleGroups
    from diffusers_zero3.rewards.pairwise_judge import PairwiseVLMJudge

    judge = PairwiseVLMJudge.from_pretrained(judge_folder, torch.float32).eval()
    placed = ParallelReward(judge, placement="replicate", micro_batch_size=2, preprocess=judge.preprocess)
    one = GroupwiseReward(placed, "pairwise")
    groups = SampleGroups([g for g, _ in judge_keys], [m for _, m in judge_keys], [True] * 5)
    judged = one(small, [f"prompt {g}" for g, _ in judge_keys], groups)
    torch.save({"images": images, **ref, "judge_images": small, "judge": judged}, tmp_path / "ref.pt")
    outs = run_on_ranks(
        worker_groupwise, timeout=240, ref_path=str(tmp_path / "ref.pt"), judge_folder=str(judge_folder)
    )
    assert all("OK groupwise" in o for o in outs)


# ------------------------------------------------------------------ the pairwise judge

VLM_PAIR_TEMPLATE = (  # Qwen2-VL's chat template rendered for [image, image, text] and the generation prompt
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>{question}"
    "<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    """A tiny Qwen2-VL (the published patch, merge and temporal sizes; narrow and shallow), its
    tokenizer ("1" and "2" one token each) and image processor config."""
    from diffusers_zero3.rewards.pairwise_judge import PAIRWISE_QUESTION
    from tests.common import tiny_qwen2_vl_judge

    folder = tmp_path_factory.mktemp("pairwise_vlm")
    words = ("1", "2", "system", "user", "assistant", "You are a helpful assistant.", PAIRWISE_QUESTION)
    model = tiny_qwen2_vl_judge(folder, words, seed=5, max_position_embeddings=1024)
    with torch.no_grad():
        model.model.visual.merger.mlp[2].weight.mul_(30.0)
    model.save_pretrained(folder)
    return folder


def _judge_reference(folder, images, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's win rate in one group, written out: for every ordered pair (i, j), Qwen2-VL's
    processor on [image i, image j] (its patches and a grid row each; the chat with each
    ``<|image_pad|>`` repeated ``grid.prod() // merge**2`` times), the next token's probabilities
    over the vocabulary, ``P("1") / (P("1") + P("2"))``; member i's reward the mean over j of
    ``(P(i, j) + 1 - P(j, i)) / 2``. Returns the ``[n, n]`` preferences and the ``[n]`` rewards."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from diffusers_zero3.rewards.pairwise_judge import PAIRWISE_QUESTION

    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    one, two = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    pil = _pil(images)
    n = len(pil)
    p = torch.zeros(n, n, dtype=torch.float64, device=CPU)
    for i, j in itertools.permutations(range(n), 2):
        vision = processor(images=[pil[i], pil[j]], return_tensors="pt")
        count = int(vision["image_grid_thw"][0].prod()) // processor.merge_size**2
        text = VLM_PAIR_TEMPLATE.format(question=PAIRWISE_QUESTION.replace("{prompt}", prompt))
        inputs = tok([text.replace("<|image_pad|>", "<|image_pad|>" * count)], return_tensors="pt")
        with torch.no_grad():
            logits = model(
                **inputs,
                pixel_values=vision["pixel_values"],
                image_grid_thw=vision["image_grid_thw"],
                mm_token_type_ids=(inputs["input_ids"] == model.config.image_token_id).long(),
            ).logits[0, -1]
        probs = logits.double().softmax(-1)
        p[i, j] = probs[one] / (probs[one] + probs[two])
    wins = [sum((p[i, j] + 1 - p[j, i]) / 2 for j in range(n) if j != i) / (n - 1) for i in range(n)]
    return p, torch.tensor(wins, dtype=torch.float64, device=CPU)


@pytest.mark.unit
def test_pairwise_judge_is_the_processor_and_model_computation(judge_folder):
    from diffusers_zero3.rewards import load_rewards, parse_reward_specs
    from diffusers_zero3.rewards.groupwise import SampleGroups

    raw = _uint8_images(4, 56, 56, seed=7)  # a multiple of 28 within min_pixels: nothing resized
    images = _as_tensor(raw)
    specs = parse_reward_specs(["pairwise_vlm"], [f"pairwise_vlm={judge_folder}"], ["pairwise_vlm=replicate"])
    assert specs[0].scope == "pairwise"
    rewards = load_rewards(specs, None, torch.float32, micro_batch_size=5)
    prompt = "a red circle"
    _, scores = rewards(images, [prompt] * 4, groups=SampleGroups([3] * 4, [0, 1, 2, 3], [True] * 4))
    prefs, want = _judge_reference(judge_folder, raw, prompt)
    # each ordered pair's P(first better), through the reward's own call on pairs
    pairs = list(itertools.permutations(range(4), 2))
    stacked = torch.stack([images[[i for i, _ in pairs]], images[[j for _, j in pairs]]], 1)
    ours = rewards.rewards["pairwise_vlm"].reward(stacked, [prompt] * len(pairs)).double()
    torch.testing.assert_close(ours, torch.stack([prefs[i, j] for i, j in pairs]), rtol=1e-5, atol=1e-7)
    assert ours.max() - ours.min() > 2e-3  # the judge's preferences differ between pairs
    # the win rates: this tiny judge hardly tells the orders apart, so they sit within 1e-4 of
    # 0.5; compared 100 times tighter than they differ
    torch.testing.assert_close(scores["pairwise_vlm"].double(), want, rtol=0, atol=1e-7)
    print(
        "max |ours - reference|: preferences",
        (ours - torch.stack([prefs[i, j] for i, j in pairs])).abs().max().item(),
        "win rates",
        (scores["pairwise_vlm"].double() - want).abs().max().item(),
        "spread",
        (want.max() - want.min()).item(),
    )
    assert want.max() - want.min() > 1e-5
    with pytest.raises(ValueError, match="need groups="):
        rewards(images, [prompt] * 4)


# ------------------------------------------------------------------ a GRPO round


def _grpo_round(pipe_dir: str, out: str) -> None:
    import torch.distributed as dist

    from diffusers_zero3.demo.rewards import redness
    from diffusers_zero3.recipes.grpo import GRPOSettings, GRPOTrainer
    from diffusers_zero3.rl import group_advantages

    settings = GRPOSettings.parse([
        "--pretrained_model_name_or_path", pipe_dir, "--reward", REDNESS, "--reward", f"{SELF}:above_group_mean=3.0",
        "--output_dir", out, "--prompts", "a red circle", "a blue square", "a green circle", "--group_size", "3",
        "--resolution", "32", "--num_inference_steps", "2", "--sample_batch_size", "2", "--train_batch_size", "2",
        "--report_to", "none", "--seed", "5",
    ])  # fmt: skip
    trainer = GRPOTrainer(settings)
    trainer.setup()
    seen = {}
    score = trainer.reward_fn

    def recorded(images, prompts, metadata=None, groups=None):
        seen["images"], seen["calls"] = images.detach().cpu(), seen.get("calls", 0) + 1
        return score(images, prompts, metadata=metadata, groups=groups)

    trainer.reward_fn = recorded
    batch = trainer.sample_round(0)
    trainer.score_round(batch)
    assert seen["calls"] == 1  # the whole round in one call
    real = batch.real.cpu()
    mine = [(p, m, img) for (p, m), img, keep in zip(batch.pairs, seen["images"], real.tolist()) if keep]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    samples = sorted({(p, m): img for share in everyone for p, m, img in share}.items())
    assert [k for k, _ in samples] == [(p, m) for p in range(3) for m in range(3)]
    images = torch.stack([img for _, img in samples])
    prompts = torch.tensor([p for (p, _), _ in samples], device=CPU)
    total = redness(images).double()
    for p in range(3):  # the group-wise term, each group whole
        rows = prompts == p
        total[rows] += 3.0 * above_group_mean(images[rows], None).double()
    want = group_advantages(total, prompts, global_std=settings.global_std)
    alone = group_advantages(redness(images).double(), prompts, global_std=settings.global_std)
    assert not torch.allclose(want, alone, atol=1e-3)  # the group-wise reward moves the advantages
    index = {k: i for i, (k, _) in enumerate(samples)}
    rows = [index[(p, m)] for (p, m), keep in zip(batch.pairs, real.tolist()) if keep]
    torch.testing.assert_close(
        batch.advantages.cpu()[real].double(), want[rows].double(), rtol=1e-4, atol=1e-4
    )
    print("OK grpo round")


@pytest.mark.multirank
def test_a_groupwise_reward_reaches_the_grpo_advantages(tiny_sd3, tmp_path):
    from tests.test_grpo_round import ZERO3_ENV

    outs = run_on_ranks(
        _grpo_round, pipe_dir=tiny_sd3[0], out=str(tmp_path / "out"), env=ZERO3_ENV, timeout=240
    )
    assert all("OK grpo round" in o for o in outs)
