"""The HiDream-I1 family against diffusers' own code: prompt encoding (four encoders, the CLIP
length rule, masks, all Llama layers) against ``HiDreamImagePipeline.encode_prompt``, the
denoiser call against the pipeline's (eval and train-mode MoE), the objective against
``train_dreambooth_lora_hidream.py``, the MoE blocks, the published parameter counts, and the
tiny pipeline with its separately supplied Llama."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["a red circle", "a photo of a big blue square shape on a green picture of the yellow sky", ""]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(pipeline folder, Llama folder)`` of the tiny pipeline."""
    from diffusers_zero3.demo import llama_folder_of, save_tiny_pipeline
    from diffusers_zero3.families import HIDREAM

    folder = save_tiny_pipeline(HIDREAM, tmp_path_factory.mktemp("hidream") / "tiny-hidream")
    return folder, llama_folder_of(folder)


def _load(folders):
    from diffusers import DiffusionPipeline
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder, llama = folders
    pipeline = DiffusionPipeline.from_pretrained(
        folder,
        text_encoder_4=LlamaForCausalLM.from_pretrained(llama),
        tokenizer_4=AutoTokenizer.from_pretrained(llama),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def pipe(folders):
    return _load(folders)


def _encode(folders, pipeline, prompts, max_sequence_length):
    from diffusers_zero3.families import HIDREAM

    folder, llama = folders
    tokenizers = HIDREAM.load_tokenizers(folder, {"tokenizer_4": llama})
    ids = HIDREAM.tokenize(tokenizers, prompts, max_sequence_length)
    encoders = {spec.name: getattr(pipeline, spec.name) for spec in HIDREAM.text_encoders}
    with torch.no_grad():
        outputs = HIDREAM.encode_texts(encoders, ids)
    return ids, outputs, HIDREAM.conditioning(outputs)


def _transformer(folder, **kwargs):
    from diffusers import HiDreamImageTransformer2DModel

    return HiDreamImageTransformer2DModel.from_pretrained(folder, subfolder="transformer", **kwargs)


@pytest.mark.parametrize("max_sequence_length", [24, 240])
def test_conditioning_equals_the_pipelines_encode_prompt(folders, pipe, max_sequence_length):
    """All three transformer inputs equal ``encode_prompt``'s; the CLIPs get
    ``min(max_sequence_length, 218)`` tokens (not their tokenizers' 77), T5 and Llama
    ``max_sequence_length``; one caption encoded alone equals its row of the batch."""
    from diffusers_zero3.families import HIDREAM, detect_family

    folder, llama = folders
    assert detect_family(folder) is HIDREAM
    ids, outputs, cond = _encode(folders, pipe, PROMPTS, max_sequence_length)
    clip_tokens = min(max_sequence_length, 218)
    assert ids["input_ids"].shape == ids["input_ids_2"].shape == (3, clip_tokens)
    assert ids["input_ids_3"].shape == ids["input_ids_4"].shape == (3, max_sequence_length)
    assert len(set(ids["attention_mask_4"].sum(dim=1).tolist())) == 3  # three lengths: the masks matter
    llama_tokenizer = HIDREAM.load_tokenizers(folder, {"tokenizer_4": llama})["text_encoder_4"]
    assert llama_tokenizer.pad_token == "<|eot_id|>"  # Llama-3 has none: the pipeline pads with its EOS
    assert bool((ids["input_ids_4"][0, 4:] == llama_tokenizer.eos_token_id).all())  # BOS, a, red, circle
    with torch.no_grad():
        t5, _, llama3, _, pooled, _ = pipe.encode_prompt(
            prompt=PROMPTS, max_sequence_length=max_sequence_length, do_classifier_free_guidance=False
        )
    assert llama3.shape == (2, 3, max_sequence_length, 16)  # every decoder layer of the tiny Llama
    assert torch.equal(cond["pooled_embeds"], pooled)
    assert torch.equal(cond["encoder_hidden_states_t5"], t5)
    assert torch.equal(cond["encoder_hidden_states_llama3"], llama3)
    # batch-first for the cache: (N, layers, L, D)
    assert outputs["llama_embeds"].shape == (3, 2, max_sequence_length, 16)
    _, _, alone = _encode(folders, pipe, PROMPTS[1:2], max_sequence_length)
    torch.testing.assert_close(alone["pooled_embeds"][0], cond["pooled_embeds"][1])
    torch.testing.assert_close(alone["encoder_hidden_states_t5"][0], cond["encoder_hidden_states_t5"][1])
    torch.testing.assert_close(
        alone["encoder_hidden_states_llama3"][:, 0], cond["encoder_hidden_states_llama3"][:, 1]
    )


def test_prediction_is_the_pipelines_transformer_call_in_eval_and_train_mode(folders, pipe):
    """``HIDREAM.predict`` equals the pipeline's transformer call and its negation (captured
    by a forward hook in a CFG run), timesteps as given; in train mode (the MoE calls every
    expert, the output is ``(N, C, S, p*p)``) the same numbers come out, for square and
    non-square latents."""
    from diffusers_zero3.families import HIDREAM

    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0].detach().clone())), with_kwargs=True
    )
    try:
        HIDREAM.prepare_validation_pipeline(pipe, 32)
        pipe(PROMPTS[:2], num_inference_steps=2, height=32, width=32, guidance_scale=5.0, max_sequence_length=24,
             generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    finally:
        hook.remove()
    assert len(calls) == 2
    kwargs, raw = calls[-1]
    assert kwargs["hidden_states"].shape == (4, 4, 16, 16)  # CFG: [negative, positive]
    # The pipeline's conditioning is ours for ["", "", *prompts]: the negative prompt is "".
    _, _, cond = _encode(folders, pipe, ["", "", *PROMPTS[:2]], 24)
    for key, value in cond.items():
        torch.testing.assert_close(value, kwargs[key])
    timesteps = kwargs["timesteps"]
    assert float(timesteps.min()) > 1  # sigma x 1000, passed as is
    transformer = pipe.transformer
    with torch.no_grad():
        ours = HIDREAM.predict(transformer, kwargs["hidden_states"], timesteps, cond)
        scaled = HIDREAM.predict(transformer, kwargs["hidden_states"], timesteps / 1000, cond)
        transformer.train()
        try:
            layout = transformer(hidden_states=kwargs["hidden_states"], timesteps=timesteps, **cond,
                                 return_dict=False)[0]  # fmt: skip
            trained = HIDREAM.predict(transformer, kwargs["hidden_states"], timesteps, cond)
            wide = torch.randn(4, 4, 16, 8)  # non-square: padded to max_seq patches in train mode
            wide_train = HIDREAM.predict(transformer, wide, timesteps, cond)
        finally:
            transformer.eval()
        wide_eval = HIDREAM.predict(transformer, wide, timesteps, cond)
    assert ours.shape == kwargs["hidden_states"].shape
    torch.testing.assert_close(ours, -raw)  # PIPE: noise_pred = -noise_pred
    assert not torch.allclose(scaled, ours, atol=1e-3)  # the timestep scale reaches the model
    assert layout.shape == (4, 4, 8 * 8, 4)
    torch.testing.assert_close(trained, -raw)
    assert wide_train.shape == wide.shape
    torch.testing.assert_close(wide_train, wide_eval)


@pytest.mark.parametrize("weighting_scheme", ["none", "logit_normal"])
def test_objective_is_diffusers_hidream_dreambooth_loss(folders, pipe, weighting_scheme):
    """``HIDREAM.loss`` against the lines of ``train_dreambooth_lora_hidream.py`` (diffusers
    58eb52c0), same seed: the scheduler from the folder with shift=3.0 (lines 1080-1082), the
    transformer with ``force_inference_output=True`` (1101-1109) in train mode, latents
    ``(z - shift) * scale`` (1581), noise then u (1585-1598), sigmas looked up by timestep
    (1545-1553, 1602), ``-transformer(...)`` at timesteps sigma x 1000 (1605-1613), target
    ``noise - latents`` (1618), the per-sample mean (1634-1638). The forward is the same on
    our train path; only ours sends gradients to the routed experts."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families import HIDREAM
    from diffusers_zero3.families.objectives import ObjectiveSettings

    folder, _ = folders
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", shift=3.0)
    assert torch.equal(HIDREAM.load_noise_scheduler(folder).sigmas, scheduler.sigmas)
    assert float(scheduler.sigmas[500]) == pytest.approx(3 * 0.5 / (1 + 2 * 0.5), abs=1e-3)  # shifted
    _, _, cond = _encode(folders, pipe, PROMPTS[:2], 24)
    vae = pipe.vae
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    script = _transformer(folder, force_inference_output=True).train()
    ours_model = _transformer(folder).train()
    with torch.no_grad():
        torch.manual_seed(5)
        model_input = vae.encode(pixels).latent_dist.sample()
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
        torch.manual_seed(5)
        latents = HIDREAM.latent_normalizer(vae.config)(
            HIDREAM.latents_of(HIDREAM.latent_distribution(vae, pixels))
        )
        torch.testing.assert_close(latents, model_input)

        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme, bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
        )
        indices = (u * scheduler.config.num_train_timesteps).long()
        timesteps = scheduler.timesteps[indices]
        step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
        sigmas = scheduler.sigmas[step_indices].flatten().view(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        model_pred = script(
            hidden_states=noisy,
            encoder_hidden_states_t5=cond["encoder_hidden_states_t5"],
            encoder_hidden_states_llama3=cond["encoder_hidden_states_llama3"],
            pooled_embeds=cond["pooled_embeds"],
            timesteps=timesteps,
            return_dict=False,
        )[0]
        model_pred = model_pred * -1
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
        target = noise - model_input
        expected = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
        ).mean()
    torch.manual_seed(7)
    ours = HIDREAM.loss(
        ours_model, scheduler, model_input, cond, ObjectiveSettings(weighting_scheme=weighting_scheme)
    )
    torch.testing.assert_close(ours.detach(), expected)
    assert expected.item() > 0.01  # a real loss, not a zero that any prediction would give
    ours.backward()
    expert = ours_model.double_stream_blocks[0].block.ff_i.experts[0].w1.weight
    gate = ours_model.double_stream_blocks[0].block.ff_i.gate.weight
    assert expert.grad is not None and gate.grad is not None and float(expert.grad.abs().sum()) > 0
    torch.manual_seed(7)
    HIDREAM.loss(
        script, scheduler, model_input, cond, ObjectiveSettings(weighting_scheme=weighting_scheme)
    ).backward()
    assert (
        script.double_stream_blocks[0].block.ff_i.experts[0].w1.weight.grad is None
    )  # the script's moe_infer


def test_mixture_of_experts_blocks_are_found_in_the_transformer_only(pipe):
    from diffusers_zero3.families import HIDREAM
    from diffusers_zero3.runtime.zero3 import mixture_of_experts_blocks

    blocks = mixture_of_experts_blocks(pipe.transformer)
    assert [c.__name__ for c in blocks] == ["MOEFeedForwardSwiGLU"]
    assert sum(isinstance(m, blocks[0]) for m in pipe.transformer.modules()) == 2  # one per block
    for name in HIDREAM.frozen_components:
        assert mixture_of_experts_blocks(getattr(pipe, name)) == [], name


def test_published_configs_give_the_published_parameter_counts():
    from diffusers_zero3.families import HIDREAM
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import build_on_meta

    (published,) = HIDREAM.published()
    assert KNOWN_PIPELINES[published.hub_id]["_class_name"] == "HiDreamImagePipeline"
    expected = {
        "transformer": 17_105_733_184,
        "text_encoder": 123_781_632,  # CLIP-L/14, 248 positions
        "text_encoder_2": 694_878_720,  # CLIP-G/14, 248 positions
        "text_encoder_3": 4_762_310_656,  # T5-XXL encoder
        "text_encoder_4": 8_030_261_248,  # Llama-3.1-8B-Instruct, supplied separately
        "vae": 83_819_683,  # Flux.1's
    }
    modules = {name: build_on_meta(*spec) for name, spec in published.components.items()}
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}
    assert counts == expected
    transformer = modules["transformer"]
    expert = sum(p.numel() for p in transformer.double_stream_blocks[0].block.ff_i.experts[0].parameters())
    moe = sum(type(m).__name__ == "MOEFeedForwardSwiGLU" for m in transformer.modules())
    assert (moe, expert) == (48, 53_084_160)
    assert counts["transformer"] - moe * 2 * expert == 12_009_653_824  # active per token: 2 of 4 experts
    assert "text_encoder_4" in published.note and "12.01 B active" in published.note


def test_tiny_pipeline_loads_with_the_llama_generates_and_takes_lora(folders, pipe):
    import json

    from diffusers import DiffusionPipeline

    from diffusers_zero3.families import HIDREAM
    from diffusers_zero3.placement.frozen_inputs import resolve_component_sources
    from diffusers_zero3.training.lora import add_lora_adapters

    folder, llama = folders
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_4"] == index["tokenizer_4"] == [None, None]
    assert (llama / "config.json").is_file() and (llama / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="text_encoder_4"):
        DiffusionPipeline.from_pretrained(folder)  # the Llama must be given
    sources = resolve_component_sources(HIDREAM, folder, {"text_encoder_4": str(llama)})
    assert sources["tokenizer_4"] == sources["text_encoder_4"] == llama
    assert "text_encoder_4={pipeline}-llama" in HIDREAM.default_run_args

    HIDREAM.prepare_validation_pipeline(pipe, 32)
    assert pipe.default_sample_size == 32 // pipe.vae_scale_factor == 16  # else ~(128 * 2)^2 pixels
    kwargs = HIDREAM.validation_kwargs(24, None)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator().manual_seed(0), **kwargs).images[0]  # fmt: skip
    assert image.size == (32, 32)

    transformer = _transformer(folder)
    _, _, cond = _encode(folders, pipe, ["a red circle"], 24)
    x, t = torch.randn(1, 4, 16, 16), torch.tensor([500.0])
    with torch.no_grad():
        before = HIDREAM.predict(transformer, x, t, cond)
    adapters = add_lora_adapters(transformer, rank=4, target_modules=HIDREAM.lora_target_modules)
    wrapped = sorted({n.split(".lora_A")[0] for n, _ in transformer.named_parameters() if ".lora_A" in n})
    assert len(adapters) == 2 * 4 * 2  # A and B of attn1's to_q/k/v/out in 2 blocks
    assert all(n.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "to_out") for n in wrapped), wrapped
    with torch.no_grad():
        after = HIDREAM.predict(transformer, x, t, cond)
    torch.testing.assert_close(after, before)  # LoRA B starts at zero
