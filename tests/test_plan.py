"""The placement planner (``python -m diffusers_zero3.placement.plan``): exact parameter counts from
configs on the meta device, bytes per placement, the recommendation, and its calibration
against a real 2-rank ZeRO-3 engine's model states."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest
import torch

from diffusers_zero3.placement.plan import PlanOptions, main, make_plan

GIB = 2**30

# Parameter counts published for these models (model cards, papers, diffusers' docs).
PUBLISHED = {
    ("runwayml/stable-diffusion-v1-5", "unet"): 859_520_964,
    ("runwayml/stable-diffusion-v1-5", "text_encoder"): 123_060_480,
    ("stabilityai/stable-diffusion-xl-base-1.0", "unet"): 2_567_463_684,
    ("stabilityai/stable-diffusion-xl-base-1.0", "text_encoder_2"): 694_659_840,
    ("stabilityai/stable-diffusion-3-medium-diffusers", "transformer"): 2_028_328_000,
    ("stabilityai/stable-diffusion-3-medium-diffusers", "text_encoder_3"): 4_762_310_656,
    ("black-forest-labs/FLUX.1-dev", "transformer"): 11_901_408_320,
    # Qwen/Qwen-Image: the transformer ("20B"; the hub's safetensors metadata) and
    # Qwen2.5-VL-7B-Instruct (its model card's 8.29B, vision tower and lm_head included)
    ("Qwen/Qwen-Image", "transformer"): 20_430_401_088,
    ("Qwen/Qwen-Image", "text_encoder"): 8_292_166_656,
    # Qwen/Qwen-Image-Edit-2509: Qwen-Image's transformer and VAE, Qwen2.5-VL-7B whose vision tower runs
    ("Qwen/Qwen-Image-Edit-2509", "transformer"): 20_430_401_088,
    ("Qwen/Qwen-Image-Edit-2509", "text_encoder"): 8_292_166_656,
    # Tongyi-MAI/Z-Image-Turbo: the transformer ("6B") and Qwen3-4B ("4.02B")
    ("Tongyi-MAI/Z-Image-Turbo", "transformer"): 6_154_908_736,
    ("Tongyi-MAI/Z-Image-Turbo", "text_encoder"): 4_022_468_096,
    # HiDream-ai/HiDream-I1-Full: the sparse MoE transformer ("17B", all experts) and the
    # separately supplied Llama-3.1-8B-Instruct ("8.03B")
    ("HiDream-ai/HiDream-I1-Full", "transformer"): 17_105_733_184,
    ("HiDream-ai/HiDream-I1-Full", "text_encoder_3"): 4_762_310_656,
    ("HiDream-ai/HiDream-I1-Full", "text_encoder_4"): 8_030_261_248,
    # black-forest-labs/FLUX.2-dev ("32B") with Mistral-Small-3.x-24B ("24B", the whole VLM)
    ("black-forest-labs/FLUX.2-dev", "transformer"): 32_223_281_152,
    ("black-forest-labs/FLUX.2-dev", "text_encoder"): 24_011_361_280,
    # Wan-AI: Wan 2.1 T2V 1.3B and 14B, Wan 2.2 T2V A14B (two 14B experts) and TI2V 5B, umT5-XXL
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "transformer"): 1_418_996_800,
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "transformer"): 14_288_491_584,
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "text_encoder"): 5_680_910_336,
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "transformer"): 14_288_491_584,
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "transformer_2"): 14_288_491_584,
    ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "transformer"): 4_999_787_712,
    # krea/Krea-2-Raw and -Turbo: the transformer (the model cards' "12.9B"; 12,820,073,036 is the
    # hub's safetensors total for krea/Krea-2-Turbo as model catalogs list it) and Qwen3-VL-4B-Instruct
    # (4,437,815,808: its loaded total, vision tower included; its language model is Qwen3-4B's 4.02B)
    ("krea/Krea-2-Raw", "transformer"): 12_820_073_036,
    ("krea/Krea-2-Raw", "text_encoder"): 4_437_815_808,
    ("krea/Krea-2-Turbo", "transformer"): 12_820_073_036,
    # NucleusAI/Nucleus-Image: the sparse MoE transformer (the model card's "17B total", 64 experts
    # in 29 of 32 blocks) and Qwen3-VL-8B-Instruct ("8.77B", vision tower and lm_head included)
    ("NucleusAI/Nucleus-Image", "transformer"): 16_922_679_296,
    ("NucleusAI/Nucleus-Image", "text_encoder"): 8_767_123_696,
    # black-forest-labs/FLUX.1-Kontext-dev: Flux.1 [dev]'s shapes ("12B"), its T5-XXL
    ("black-forest-labs/FLUX.1-Kontext-dev", "transformer"): 11_901_408_320,
    ("black-forest-labs/FLUX.1-Kontext-dev", "text_encoder_2"): 4_762_310_656,
    # ideogram-ai/ideogram-v4: the conditional transformer (Ideogram4Transformer2DModel's defaults:
    # 34 blocks at width 4608; its unconditional twin is frozen and not planned) and Qwen3-VL-8B-Instruct
    # as a head-less Qwen3VLModel (vision tower included; its language model 7,568,405,504)
    ("ideogram-ai/ideogram-v4", "transformer"): 9_279_288_448,
    ("ideogram-ai/ideogram-v4", "text_encoder"): 8_144_793_840,
    # hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v: the transformer (the model card's "8.3B") and
    # Qwen2.5-VL-7B-Instruct's text model alone (Qwen2_5_VLTextModel: no vision tower, no lm_head)
    ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "transformer"): 8_326_608_160,
    ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "text_encoder"): 7_070_619_136,
    # Lightricks/LTX-2: the audio-video transformer (the model card's "19B": 14B video + 5B audio
    # streams) and Gemma 3 12B whole as the pipeline loads it (google/gemma-3-12b-it's "12.2B")
    ("Lightricks/LTX-2", "transformer"): 18_876_174_592,
    ("Lightricks/LTX-2", "text_encoder"): 12_202_563_392,
}


@pytest.mark.unit
@pytest.mark.parametrize("pipeline", sorted({p for p, _ in PUBLISHED}))
def test_carried_configs_give_the_published_parameter_counts(pipeline):
    plan = make_plan(pipeline, PlanOptions(num_processes=8, mixed_precision="bf16"))
    for (p, name), count in PUBLISHED.items():
        if p == pipeline:
            assert plan["components"][name]["parameters"] == count, name
    trained = [n for n, c in plan["components"].items() if c["trainable"]]
    two_experts = "transformer_2" in plan["components"]
    assert trained == (["transformer", "transformer_2"] if two_experts else
                       [("transformer" if "unet" not in plan["components"] else "unet")])  # fmt: skip


def _loaded(folder, name, cls_name):
    import importlib

    for lib in ("diffusers", "transformers"):
        cls = getattr(importlib.import_module(lib), cls_name, None)
        if cls is not None:
            return cls.from_pretrained(folder, subfolder=name)
    raise AssertionError(cls_name)


@pytest.mark.unit
def test_plan_of_a_local_folder_counts_and_sizes_exactly(tiny_sd3):
    folder = tiny_sd3[0]
    plan = make_plan(folder, PlanOptions(num_processes=2, use_ema=True))
    assert set(plan) >= {"num_processes", "components", "recommended", "total_bytes_per_rank"}
    assert plan["num_processes"] == 2
    assert set(plan["components"]) == {
        "transformer",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "vae",
    }
    for name, comp in plan["components"].items():
        model = _loaded(folder, name, comp["class"])
        numels = [p.numel() for p in model.parameters()]
        assert comp["parameters"] == sum(numels), name
        if comp["trainable"]:
            continue
        places = comp["placements"]
        assert places["replicate"]["bytes_per_rank"] == 4 * sum(numels)
        # DeepSpeed's partition of each parameter; those under the persistence threshold whole
        from diffusers_zero3.runtime.ds_config import zero3_bucket_sizes

        threshold = zero3_bucket_sizes(model)["stage3_param_persistence_threshold"]
        expected = sum(math.ceil(n / 2) + (n if n <= threshold else 0) for n in numels) * 4
        assert places["shard"]["bytes_per_rank"] == expected
        assert places["cache"]["bytes_per_rank"] == 0 and places["cache"]["cache_bytes_per_image"] > 0
    unet = plan["components"]["transformer"]["placements"]["shard"]
    psi = plan["components"]["transformer"]["parameters"]
    own = math.ceil(psi / 2)
    assert (unet["gradients"], unet["optimizer"], unet["ema"]) == (4 * own, 8 * own, 4 * own)
    assert plan["total_bytes_per_rank"] == sum(
        plan["components"][n]["placements"][p]["bytes_per_rank"] for n, p in plan["recommended"].items()
    )


@pytest.mark.unit
def test_the_vae_cache_holds_the_latent_distribution_per_image(tiny_pipeline):
    plan = make_plan(str(tiny_pipeline), PlanOptions(num_processes=2, resolution=32))
    # 4 latent channels, mean and log-variance, 32 px / 2 (two VAE blocks), fp32
    assert plan["components"]["vae"]["placements"]["cache"]["cache_bytes_per_image"] == 2 * 4 * 16 * 16 * 4


SD15 = "runwayml/stable-diffusion-v1-5"


@pytest.mark.unit
def test_recommendation_replicates_where_it_fits_and_shards_where_it_must():
    roomy = make_plan(SD15, PlanOptions(num_processes=8, device_memory=80 * GIB, mixed_precision="bf16"))
    assert roomy["fits"] and roomy["recommended"] == {
        "unet": "shard",
        "text_encoder": "replicate",
        "vae": "replicate",
    }
    # a budget between "all replicated" and "text encoder sharded": only the largest frozen model moves
    comps = roomy["components"]
    replicated = roomy["total_bytes_per_rank"]
    te = comps["text_encoder"]["placements"]
    needed = replicated - te["replicate"]["bytes_per_rank"] + te["shard"]["bytes_per_rank"]
    tight = PlanOptions(num_processes=8, mixed_precision="bf16", device_memory=int((needed + 1000) / 0.75))
    plan = make_plan(SD15, tight)
    assert plan["fits"] and plan["recommended"]["text_encoder"] == "shard"
    assert plan["recommended"]["vae"] == "replicate"
    tight.fixed_data = True  # outputs depend on the data alone: cache instead of shard
    assert make_plan(SD15, tight)["recommended"]["text_encoder"] == "cache"


@pytest.mark.unit
def test_when_nothing_fits_it_says_what_would():
    plan = make_plan(
        "black-forest-labs/FLUX.1-dev",
        PlanOptions(num_processes=2, device_memory=24 * GIB, mixed_precision="bf16"),
    )
    assert not plan["fits"]
    advice = " ".join(plan["advice"])
    assert "--num_processes 32" in advice or "--num_processes 16" in advice, advice
    assert "LoRA" in advice
    n = int(advice.split("--num_processes ")[1].split(")")[0])
    bigger = make_plan(
        "black-forest-labs/FLUX.1-dev",
        PlanOptions(num_processes=n, device_memory=24 * GIB, mixed_precision="bf16"),
    )
    smaller = make_plan(
        "black-forest-labs/FLUX.1-dev",
        PlanOptions(num_processes=n // 2, device_memory=24 * GIB, mixed_precision="bf16"),
    )
    assert bigger["fits"] and not smaller["fits"]


@pytest.mark.unit
def test_lora_counts_the_adapters_peft_adds(tiny_pipeline):
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.families import SD
    from diffusers_zero3.placement.plan import lora_parameters
    from diffusers_zero3.training.lora import add_lora_adapters

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    predicted = lora_parameters(unet, 4, SD.lora_target_modules)
    adapters = add_lora_adapters(unet, rank=4, target_modules=list(SD.lora_target_modules))
    assert predicted == sum(p.numel() for p in adapters) > 0


@pytest.mark.unit
def test_command_line_json_and_bad_input(capsys, tiny_pipeline, tmp_path):
    assert main([str(tiny_pipeline), "--num_processes", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    comp = plan["components"]["unet"]
    assert set(comp) >= {"class", "parameters", "trainable", "placements"}
    assert comp["placements"]["shard"]["bytes_per_rank"] > 0
    assert main([str(tiny_pipeline), "--num_processes", "2", "--device_memory", "1GiB"]) == 0
    table = capsys.readouterr().out
    assert "recommended (*)" in table and "*shard" in table
    for argv, words in [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(tiny_pipeline), "--num_processes", "3", "--num_machines", "2"], "multiple of --num_machines"),
        ([str(tiny_pipeline), "--rank", "0"], "--rank"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


@pytest.mark.unit
def test_memory_sizes_parse():
    from diffusers_zero3.placement.plan import parse_bytes

    assert parse_bytes("80GiB") == parse_bytes("80GB") == 80 * GIB
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


# ---------------------------------------------------------------- calibration (2 ranks)


def worker_engine_states_match_the_plan(pipe_dir: str):
    import deepspeed
    from diffusers import UNet2DConditionModel

    from diffusers_zero3 import load_pretrained_zero3, model_state_bytes, share_fp32_master_weights
    from diffusers_zero3.runtime.ds_config import zero3_bucket_sizes
    from tests.common import accelerator_with_zero3, zero3_config

    acc = accelerator_with_zero3(zero3_init_flag=True)
    plan = make_plan(pipe_dir, PlanOptions(num_processes=2))["components"]["unet"]["placements"]["shard"]
    engines = []
    for share in (True, False):
        torch.manual_seed(0)
        unet = load_pretrained_zero3(UNet2DConditionModel, pipe_dir, "unet", accelerator=acc)
        config = zero3_config(**zero3_bucket_sizes(unet))  # as the scripts fill them in
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-2)
        engine, opt, *_ = deepspeed.initialize(model=unet, optimizer=optimizer, config=config)
        freed = share_fp32_master_weights(opt) if share else 0
        engines.append((engine, freed))
    torch.manual_seed(1)
    x, t = torch.randn(1, 4, 8, 8), torch.tensor([10])
    h = torch.randn(1, 77, engines[0][0].module.config.cross_attention_dim)
    for engine, _ in engines:  # the same steps for both
        for _ in range(2):
            engine.backward(engine(x, t, h).sample.pow(2).mean())
            engine.step()
    (shared, freed), (plain, _) = engines
    states = model_state_bytes(shared, shared.optimizer)
    plain_states = model_state_bytes(plain, plain.optimizer)
    # positive control: DeepSpeed keeps a second fp32 copy of the partition unless shared
    assert freed > 0 and plain_states["optimizer"] == states["optimizer"] + freed
    for kind in ("parameters", "gradients", "optimizer"):
        assert abs(states[kind] - plan[kind]) <= 0.1 * plan[kind], (kind, states[kind], plan[kind])
    # the shared engine trained exactly like the plain one
    from diffusers_zero3 import gathered_parameters

    for (n, a), (_, b) in zip(shared.module.named_parameters(), plain.module.named_parameters()):
        with gathered_parameters([a, b]):
            assert torch.equal(a, b), n
    print("CALIBRATED", {k: (states[k], plan[k]) for k in ("parameters", "gradients", "optimizer")})


@pytest.mark.multirank
def test_engine_model_states_match_the_plan_and_sharing_fp32_weights_changes_nothing(tiny_pipeline):
    from tests.distributed_harness import run_on_ranks

    outputs = run_on_ranks(worker_engine_states_match_the_plan, pipe_dir=str(tiny_pipeline))
    assert all("CALIBRATED" in out for out in outputs)


def _sd_with_short_clip(folder, positions: int):
    """The tiny SD pipeline, with a CLIP text encoder of ``positions`` position embeddings and
    its tokenizer's ``model_max_length`` set to match (a pipeline the training script runs)."""
    import shutil

    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from diffusers_zero3.demo import save_tiny_sd_pipeline, tiny_component_configs

    save_tiny_sd_pipeline(folder)
    cfg = dict(tiny_component_configs()["text_encoder"], max_position_embeddings=positions)
    torch.manual_seed(0)
    shutil.rmtree(folder / "text_encoder")
    CLIPTextModel(CLIPTextConfig(**cfg)).save_pretrained(folder / "text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer", model_max_length=positions)
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder


@pytest.mark.unit
def test_text_encoder_sequence_length_comes_from_the_tokenizer_as_in_training(tmp_path):
    """Issue 22: a CLIP of 32 positions (tokenizer ``model_max_length`` 32) planned at 77 tokens
    failed with "Sequence length must be less than max_position_embeddings"; the planner sizes
    the cache with the tokens the training script feeds the encoder (``Family.sequence_length``)."""
    from transformers import CLIPTextModel

    from diffusers_zero3.families import SD

    folder = _sd_with_short_clip(tmp_path / "short-clip", 32)
    tokenizers = SD.load_tokenizers(folder)
    spec = SD.text_encoders[0]
    length = SD.sequence_length(spec, tokenizers["text_encoder"])
    assert length == 32
    plan = make_plan(str(folder), PlanOptions(num_processes=2))
    cached = plan["components"]["text_encoder"]["placements"]["cache"]["cache_bytes_per_image"]
    encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
    assert cached == encoder.config.hidden_size * 32 * 4  # hidden size x 32 tokens x fp32
    # what training stores per caption: the encoder's outputs for one tokenized caption
    ids = SD.tokenize(tokenizers, ["a red square"])
    with torch.no_grad():
        stored = SD.encode_text("text_encoder", encoder, ids[spec.input_key])
    assert cached == sum(t.numel() * t.element_size() for t in stored.values())
    assert main([str(folder), "--num_processes", "2", "--mixed_precision", "bf16", "--json"]) == 0
    import shutil

    shutil.rmtree(folder / "tokenizer")  # configs only: the encoder's 32 positions
    plan = make_plan(str(folder), PlanOptions(num_processes=2))
    assert plan["components"]["text_encoder"]["placements"]["cache"]["cache_bytes_per_image"] == cached


@pytest.mark.unit
def test_sequence_length_rules_without_tokenizer_files():
    """Configs without tokenizer files (carried, or a folder of configs only): a CLIP's
    ``max_position_embeddings`` up to 77; a tokenizer length never past the positions; T5
    takes ``--max_sequence_length`` or the family's default."""
    from diffusers_zero3.demo import tiny_component_configs
    from diffusers_zero3.families import FLUX, SD
    from diffusers_zero3.placement.plan import Component, text_sequence_length

    clip = tiny_component_configs()["text_encoder"]

    def length(positions, tokenizer_max_length=None, family=SD, index=0, config=None, max_len=None):
        config = config or dict(clip, max_position_embeddings=positions)
        spec = family.text_encoders[index]
        comp = Component(spec.name, "transformers", spec.model_class, config, False, tokenizer_max_length)
        return text_sequence_length(comp, spec, family, max_len)

    assert length(32) == 32 and length(77) == 77 and length(128) == 77
    assert length(77, tokenizer_max_length=16) == 16
    assert length(32, tokenizer_max_length=10**30) == 32  # transformers' "no limit" sentinel
    t5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, is_encoder_decoder=False)
    assert length(None, family=FLUX, index=1, config=t5) == FLUX.default_max_sequence_length == 512
    assert length(None, family=FLUX, index=1, config=t5, max_len=100) == 100
    assert length(None, 16, family=FLUX, index=1, config=t5, max_len=100) == 100
    # the carried SD 1.5 config: CLIP-L's 77 tokens x 768, bf16
    plan = make_plan(SD15, PlanOptions(num_processes=8, mixed_precision="bf16"))
    cache = plan["components"]["text_encoder"]["placements"]["cache"]["cache_bytes_per_image"]
    assert cache == 768 * 77 * 2


@pytest.mark.unit
def test_a_vision_language_encoder_is_counted_whole_and_the_plan_says_so(tiny_qwenimage):
    """Qwen2.5-VL runs its text path only, but loads (and is placed) whole: the counts include
    its vision tower, and a note says how much of it never runs; a CLIP gets no such note."""
    plan = make_plan("Qwen/Qwen-Image", PlanOptions(num_processes=8, mixed_precision="bf16"))
    assert plan["components"]["text_encoder"]["parameters"] == 8_292_166_656
    assert plan["notes"] == [
        "text_encoder (Qwen2_5_VLForConditionalGeneration) is counted whole as it loads: 676,550,144 of its "
        "8,292,166,656 parameters are its vision tower, which never runs (only the text path encodes prompts)"
    ]
    # The cache of a templated encoder: 512 caption tokens of 3584 bf16 values (the 34 template tokens
    # it drops are fed, not stored), plus their mask.
    cache = plan["components"]["text_encoder"]["placements"]["cache"]["cache_bytes_per_image"]
    assert cache == (512 * 3584 + 512) * 2
    local = make_plan(tiny_qwenimage[0], PlanOptions(num_processes=2))
    assert len(local["notes"]) == 1 and "vision tower" in local["notes"][0]
    assert make_plan("runwayml/stable-diffusion-v1-5", PlanOptions())["notes"] == []


@pytest.mark.unit
def test_a_video_plan_says_its_activations_grow_with_the_clip():
    video = make_plan("Wan-AI/Wan2.1-T2V-14B-Diffusers", PlanOptions(num_processes=8, mixed_precision="bf16"))
    assert any("frames x height x width" in n for n in video["notes"])
    image = make_plan("Qwen/Qwen-Image", PlanOptions(num_processes=8, mixed_precision="bf16"))
    assert not any("frames x height x width" in n for n in image["notes"])


@pytest.mark.unit
def test_a_cached_video_vae_is_counted_per_clip():
    """81 frames of 480 x 832 through Wan 2.1's VAE (8x spatial, 4x temporal, 16 channels):
    21 latent frames of 60 x 104, mean and log-variance, in the VAE's fp32."""

    def vae_cache(**size):
        options = PlanOptions(num_processes=8, mixed_precision="bf16", **size)
        plan = make_plan("Wan-AI/Wan2.1-T2V-14B-Diffusers", options)
        return plan["components"]["vae"]["placements"]["cache"]["cache_bytes_per_image"]

    assert vae_cache(num_frames=81, height=480, width=832) == 2 * 16 * 21 * 60 * 104 * 4
    assert vae_cache(height=480, width=832) == 2 * 16 * 1 * 60 * 104 * 4  # one frame: an image
    assert vae_cache(resolution=1024) == 2 * 16 * 128 * 128 * 4
    # an image family ignores --num_frames
    image = make_plan("Qwen/Qwen-Image", PlanOptions(num_frames=81, resolution=1024))
    assert (
        image["components"]["vae"]["placements"]["cache"]["cache_bytes_per_image"] == 2 * 16 * 128 * 128 * 4
    )
    from diffusers_zero3.placement.plan import options_from_args, parser

    with pytest.raises(ValueError, match="--num_frames must be at least 1"):
        options_from_args(parser().parse_args(["Wan-AI/Wan2.1-T2V-14B-Diffusers", "--num_frames", "0"]))


@pytest.mark.unit
def test_the_planner_answers_under_each_of_its_command_names(capsys, monkeypatch, tiny_pipeline):
    """The console entry point (setup.cfg, as installed) and the first module path ``python -m
    diffusers_zero3.plan`` (a user's command from an older README) run ``main`` of
    ``diffusers_zero3.placement.plan`` and print its plan (run in this process: runpy runs the
    old path as ``-m`` would)."""
    import runpy
    import sys
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "diffusers-zero3-plan"]
    assert script.value == "diffusers_zero3.placement.plan:main"
    argv = [str(tiny_pipeline), "--num_processes", "2", "--json"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["diffusers_zero3.plan", *argv])
    sys.modules.pop("diffusers_zero3.plan", None)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("diffusers_zero3.plan", run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out == expected


@pytest.mark.unit
def test_the_reference_and_reward_models_are_counted_per_placement_and_never_cached(tmp_path, capsys):
    """An RL job's other frozen models: a 7 B judge (Qwen2.5-VL-7B-Instruct's published config,
    8.29 B parameters) at 8 ranks in bf16 holds 1/8 of its weights per rank sharded, all of them
    replicated, none on the device offloaded, and has no cache row (it scores fresh samples);
    the full fine-tuning reference is the denoiser's size, and with LoRA there is none."""
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES

    _, class_name, config = KNOWN_PIPELINES["Qwen/Qwen-Image"]["components"]["text_encoder"]
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({**config, "architectures": [class_name]}))
    sd3 = "stabilityai/stable-diffusion-3-medium-diffusers"
    options = PlanOptions(
        num_processes=8,
        mixed_precision="bf16",
        fixed_data=True,
        reference=True,
        reward_models={"vlm": str(judge)},
    )
    plan = make_plan(sd3, options)
    reward, reference = plan["components"]["reward:vlm"], plan["components"]["reference"]
    assert reward["parameters"] == 8_292_166_656 and not reward["trainable"]
    rows = reward["placements"]
    assert set(rows) == {"replicate", "shard", "offload"}  # no cache, even with --fixed_data
    assert rows["replicate"]["bytes_per_rank"] == 2 * 8_292_166_656
    # 1/8 of the weights plus the small tensors kept whole (under the persistence threshold):
    # 2.39 GB of the 16.6 GB
    assert 2 * 8_292_166_656 / 8 <= rows["shard"]["bytes_per_rank"] < 1.2 * 2 * 8_292_166_656 / 8
    assert rows["offload"]["bytes_per_rank"] == 0
    assert rows["offload"]["host_bytes_per_rank"] == rows["shard"]["bytes_per_rank"]
    assert reference["parameters"] == plan["components"]["transformer"]["parameters"] == 2_028_328_000
    assert "cache" not in reference["placements"]
    assert plan["recommended"]["reward:vlm"] == "replicate"  # no memory limit: the fastest
    # 24 GiB per rank: the judge can no longer be replicated, and is sharded, not cached
    tight = make_plan(sd3, replace(options, device_memory=24 * GIB))
    assert tight["recommended"]["reward:vlm"] == "shard" and tight["fits"]
    assert "reference" not in make_plan(sd3, replace(options, rank=16))["components"]

    assert main([sd3, "--num_processes", "8", "--reward_model", f"vlm={judge}", "--reference", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "reward:vlm" in printed["components"]
    assert not any("reward:vlm" in note for note in printed["notes"])  # a judge runs its vision tower
    for argv, words in [
        ([sd3, "--reward_model", "vlm"], "--reward_model takes NAME=FOLDER"),
        ([sd3, "--reward_model", f"a={judge}", "--reward_model", f"a={judge}"], "given twice"),
        ([sd3, "--reward_model", f"a={tmp_path}"], "config.json"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
