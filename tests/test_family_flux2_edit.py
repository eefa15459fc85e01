"""Flux.2 with reference images (instruction editing, both ``flux2`` and ``flux2-klein``) against
diffusers: the transformer call against the pipelines' with ``image=[...]`` (one and two
references, captured with a forward hook, fp32 and bf16), the sources encoded by
``FrozenInputs`` as ``_encode_vae_image`` encodes them, the loss against
``train_dreambooth_lora_flux2_klein_img2img.py``'s lines (the target's tokens alone), the
trainer's choice of the editing variant, and its bad input (one ``error:`` line)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.unit

VARIANTS = ("dev", "klein")
PROMPT = "make the circle blue"
LENGTH = 48  # dev's system message takes 32 tokens
DIFFS: dict = {}  # measured max |ours - pipeline| (printed with -s)


def _family(variant):
    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN

    return (FLUX2 if variant == "dev" else FLUX2_KLEIN).editing_variant()


@pytest.fixture(scope="module")
def folders(tiny_flux2, tiny_flux2_klein):
    from pathlib import Path

    return {"dev": Path(tiny_flux2[0]), "klein": Path(tiny_flux2_klein[0])}


def load(variant, folder, dtype=torch.float32):
    """The pipeline without torchvision (FLUX.2-dev's PixtralProcessor folder: the family's tokenizer)."""
    import diffusers

    family = _family(variant)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(
        folder, tokenizer=None, torch_dtype=dtype
    )
    pipe.register_modules(tokenizer=family.load_tokenizer(folder / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def frozen_inputs(family, pipe, folder, dtype):
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.placement.frozen_inputs import ComponentFolders, FrozenInputs

    return FrozenInputs(
        family, {"vae": pipe.vae, "text_encoder": pipe.text_encoder}, None,
        normalize_latents=family.latent_normalizer(pipe.vae.config, folder / "vae"), dtype=dtype,
        pixels=RowsToPixels(resolution=32), sources=ComponentFolders(),
    )  # fmt: skip


def cond_of(family, pipe, folder, prompts, dtype):
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    ids = family.tokenize(family.load_tokenizers(folder), prompts, LENGTH)
    with torch.no_grad():
        outputs = family.encode_texts({"text_encoder": pipe.text_encoder}, ids)
    return conditioning_on(family, outputs, torch.device("cpu"), dtype)


def images(count, seed=0, size=(96, 64)):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return [
        Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(count)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_predict_is_the_pipelines_call_with_reference_images(variant, dtype, folders):
    """The pipeline edits K = 1 and K = 2 references of 64x96 (its least side is 64) into a 32x32 target (one step; klein:
    CFG's two calls): each transformer call is ``predict``'s on the same noisy target with
    ``FrozenInputs``' source latents: the target's tokens, then each reference's with ids
    ``(10 + 10 k, y, x, 0)``, the same text rows and guidance; the output the target's tokens'.
    fp32: equal. bf16: the pipeline normalises with the bf16 VAE's rounded statistics, the family
    with the fp32 ones of the VAE's files (as the scripts' targets): close."""
    from diffusers_zero3.families.flux2 import latent_ids, pack_latents, reference_ids, unpack_latents

    family, folder = _family(variant), folders[variant]
    pipe = load(variant, folder, dtype)
    # The pipeline's preprocess hands its VAE a channels-last view, whose convolutions round
    # differently (by 6e-7 here) from the contiguous batches training gives it: the same pixels,
    # made contiguous, so that fp32 compares exactly.
    preprocess = pipe.image_processor.preprocess
    pipe.image_processor.preprocess = lambda *a, **kw: preprocess(*a, **kw).contiguous()
    inputs = frozen_inputs(family, pipe, folder, dtype)
    cond = cond_of(family, pipe, folder, [PROMPT], dtype)
    uncond = cond_of(family, pipe, folder, [""], dtype)
    h, w, tokens = 8, 8, 64  # 32 px: the tiny VAE's 2x, then 2x2 patches
    for count in (1, 2):
        refs = images(count, seed=count)
        calls = []
        hook = pipe.transformer.register_forward_hook(
            lambda m, a, kw, out, calls=calls: calls.append(
                ({k: v for k, v in kw.items()}, out[0].detach().clone())
            ),
            with_kwargs=True,
        )
        with torch.no_grad():
            pipe(image=refs, prompt=PROMPT, height=32, width=32, num_inference_steps=1, guidance_scale=2.5,
                 max_sequence_length=LENGTH, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
        hook.remove()
        assert len(calls) == (1 if variant == "dev" else 2)
        pixels = torch.stack(
            [pipe.image_processor.preprocess(r, 64, 96, resize_mode="crop")[0] for r in refs]
        )
        with torch.no_grad():
            source = inputs.source_latents(pixels.unsqueeze(0), torch.device("cpu"))  # (1, K, C, h, w)
        assert source.shape == (1, count, 16, 16, 24) and source.dtype == dtype
        for kwargs, expected in calls:
            assert kwargs["hidden_states"].shape[1] == tokens + count * 384
            text = (
                cond
                if torch.equal(kwargs["encoder_hidden_states"], cond["encoder_hidden_states"])
                else uncond
            )
            noisy = unpack_latents(kwargs["hidden_states"][:, :tokens], h, w)
            ours_calls = []
            hook = pipe.transformer.register_forward_hook(
                lambda m, a, kw, out, ours_calls=ours_calls: ours_calls.append({k: v for k, v in kw.items()}),
                with_kwargs=True,
            )
            with torch.no_grad():
                ours = family.predict(pipe.transformer, noisy, kwargs["timestep"] * 1000,
                                      {**text, "source_latents": source}, guidance_scale=2.5)  # fmt: skip
            hook.remove()
            (mine,) = ours_calls
            for key in ("img_ids", "txt_ids", "encoder_hidden_states", "guidance", "timestep"):
                a, b = mine[key], kwargs[key]
                assert (a is None and b is None) or torch.equal(a, b), key
            assert torch.equal(
                mine["img_ids"][0], torch.cat([latent_ids(1, h, w)[0], reference_ids(1, count, 16, 24)[0]])
            )
            assert mine["img_ids"][0, tokens:, 0].unique().tolist() == [10 * (k + 1) for k in range(count)]
            assert torch.equal(mine["hidden_states"][:, :tokens], kwargs["hidden_states"][:, :tokens])
            assert torch.equal(mine["hidden_states"][:, tokens:],
                               torch.cat([pack_latents(source[:, k]) for k in range(count)], 1))  # fmt: skip
            # fp32: equal for one source; two are one VAE batch here, one call each in the
            # pipeline (its convolutions round by up to 7e-7 apart)
            fp32 = 0 if count == 1 else 1e-6
            close = dict(rtol=0, atol=fp32) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(mine["hidden_states"], kwargs["hidden_states"], **close)
            assert ours.shape == (1, 16, h, w) and ours.dtype == dtype
            close = dict(rtol=0, atol=10 * fp32) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
            torch.testing.assert_close(ours, unpack_latents(expected[:, :tokens], h, w), **close)
            DIFFS[(variant, str(dtype), count)] = max(
                DIFFS.get((variant, str(dtype), count), 0.0),
                (mine["hidden_states"].float() - kwargs["hidden_states"].float()).abs().max().item(),
                (ours.float() - unpack_latents(expected[:, :tokens], h, w).float()).abs().max().item(),
            )
    if dtype == torch.float32:  # the references reach the model, in their order
        a, b = source[:, :1], source[:, 1:]
        with torch.no_grad():
            one, two = (family.predict(pipe.transformer, noisy, torch.tensor([500.0]), {**cond, "source_latents": s})
                        for s in (torch.cat([a, b], 1), torch.cat([b, a], 1)))  # fmt: skip
            plain = family.predict(pipe.transformer, noisy, torch.tensor([500.0]), cond)
        assert not torch.allclose(one, two, atol=1e-4) and not torch.allclose(one, plain, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_is_the_img2img_scripts_loss_on_the_targets_tokens(variant, folders):
    """``family.loss`` with ``cond["source_latents"]`` against ``train_dreambooth_lora_flux2_klein_img2img.py``
    (diffusers 58eb52c0, lines 1697-1783: cond latents as the target's, ids of one sample's
    reference expanded to the batch, the packed call, the prediction cut to the target's
    tokens, target ``noise - latents``), batch 2, under one seed. (The dev script,
    ``..._flux2_img2img.py`` 1758-1764, numbers the batch's references 10, 20, ... as one
    sample's: the pipeline's and the klein script's per-sample ids are kept.)"""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    from diffusers_zero3.families.objectives import ObjectiveSettings

    family, folder = _family(variant), folders[variant]
    pipe = load(variant, folder)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    noise_scheduler_copy = copy.deepcopy(scheduler)
    vae = AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae")
    transformer = pipe.transformer
    g = torch.Generator().manual_seed(4)
    pixel_values, cond_pixel_values = (torch.rand(2, 3, 32, 32, generator=g) * 2 - 1 for _ in range(2))
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(
            [PROMPT, "a square"], device="cpu", max_sequence_length=LENGTH
        )
        latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        model_input = vae.encode(pixel_values).latent_dist.mode()
        cond_model_input = vae.encode(cond_pixel_values).latent_dist.mode()
        model_input = Flux2KleinPipeline._patchify_latents(model_input)
        model_input = (model_input - latents_bn_mean) / latents_bn_std
        cond_model_input = Flux2KleinPipeline._patchify_latents(cond_model_input)
        cond_model_input = (cond_model_input - latents_bn_mean) / latents_bn_std
        model_input_ids = Flux2KleinPipeline._prepare_latent_ids(model_input)
        cond_model_input_ids = Flux2KleinPipeline._prepare_image_ids([cond_model_input[0:1]])
        cond_model_input_ids = cond_model_input_ids.expand(cond_model_input.shape[0], -1, -1)
        torch.manual_seed(7)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme="none", batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices]
        sigmas = noise_scheduler_copy.sigmas[[(noise_scheduler_copy.timesteps == t).nonzero().item()
                                              for t in timesteps]].flatten().view(-1, 1, 1, 1)  # fmt: skip
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = Flux2KleinPipeline._pack_latents(noisy_model_input)
        packed_cond_model_input = Flux2KleinPipeline._pack_latents(cond_model_input)
        orig_input_shape = packed_noisy_model_input.shape
        orig_input_ids_shape = model_input_ids.shape
        packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_model_input], dim=1)
        model_input_ids = torch.cat([model_input_ids, cond_model_input_ids], dim=1)
        guidance = torch.full([1], 3.5).expand(bsz) if transformer.config.guidance_embeds else None
        model_pred = transformer(
            hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
            encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=model_input_ids, return_dict=False,
        )[0]  # fmt: skip
        model_pred = model_pred[:, : orig_input_shape[1], :]
        model_input_ids = model_input_ids[:, : orig_input_ids_shape[1], :]
        model_pred = Flux2KleinPipeline._unpack_latents_with_ids(model_pred, model_input_ids)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
        ).mean()

        inputs = frozen_inputs(family, pipe, folder, torch.float32)
        ids = family.tokenize(family.load_tokenizers(folder), [PROMPT, "a square"], LENGTH)
        batch = {**ids, "pixel_values": pixel_values, "source_pixel_values": cond_pixel_values.unsqueeze(1),
                 "index": torch.tensor([0, 1])}  # fmt: skip
        latents, cond, _ = inputs(batch, torch.device("cpu"))
        torch.testing.assert_close(latents, model_input, rtol=0, atol=0)
        torch.testing.assert_close(cond["source_latents"][:, 0], cond_model_input, rtol=0, atol=0)
        settings = ObjectiveSettings(guidance_scale=3.5)
        torch.manual_seed(7)
        ours = family.loss(transformer, scheduler, latents, cond, settings)
        torch.manual_seed(7)
        other = family.loss(transformer, scheduler, latents, {**cond, "source_latents": cond["source_latents"].flip(0)},
                            settings)  # fmt: skip
    torch.testing.assert_close(ours, loss, rtol=1e-6, atol=1e-7)
    assert loss.item() > 0.01 and other.item() != ours.item()  # a real loss, and the sources reach it


def test_the_trainer_takes_the_editing_variant_for_editing_pairs(tmp_path):
    """One pipeline class trains both ways: ``detect_family`` gives the text-to-image family; the
    trainer takes ``editing_variant()`` (``edits=True``, nothing else changed) when the data flags
    give editing pairs (``gives_edit_pairs``): a source or instruction column, or a pair folder."""
    from diffusers_zero3.data.pairs import gives_edit_pairs
    from diffusers_zero3.demo import write_shapes_dataset
    from diffusers_zero3.demo.edits import write_edit_pairs
    from diffusers_zero3.families import FLUX2, FLUX2_KLEIN, KONTEXT

    for family in (FLUX2, FLUX2_KLEIN):
        edit = family.editing_variant()
        assert edit.edits and not family.edits and type(edit) is type(family)
        assert dataclasses.replace(edit, edits=False) == family
    assert KONTEXT.editing_variant() is None  # an editing family only edits
    pairs = write_edit_pairs(tmp_path / "pairs", num_pairs=2)
    shapes = write_shapes_dataset(tmp_path / "shapes", num_images=2)  # a parquet folder: no metadata.* either
    assert gives_edit_pairs(None, None, None, str(pairs))
    assert not gives_edit_pairs(None, None, None, str(shapes))
    assert gives_edit_pairs("cond", None, None, str(shapes)) and gives_edit_pairs(
        None, "edit", "hub/id", None
    )
    assert not gives_edit_pairs(None, None, "hub/id", None)


def test_bad_editing_input_is_one_error_line(folders, tmp_path, capfd):
    """A pair folder with a target whose source is missing, a source column that a
    text-to-image dataset does not have, a cached VAE with pairs, and a validation source
    smaller than the pipeline takes (32 px): one ``error:`` line each, exit 2."""
    from diffusers_zero3.demo import write_shapes_dataset
    from diffusers_zero3.demo.edits import write_edit_pairs
    from tests.test_bad_input import _run_in_process

    pairs = str(write_edit_pairs(tmp_path / "pairs", num_pairs=2))
    broken = write_edit_pairs(tmp_path / "broken", num_pairs=2)
    (broken / "00001_source.png").unlink()
    shapes = str(write_shapes_dataset(tmp_path / "shapes", num_images=2))
    common = ["--pretrained_model_name_or_path", str(folders["klein"]), "--resolution", "32",
              "--train_batch_size", "1", "--max_train_steps", "1", "--report_to", "none"]  # fmt: skip
    cases = [
        (["--train_data_dir", str(broken)], "00001.png has no source image 00001_source.png"),
        (["--train_data_dir", shapes, "--source_image_column", "source_image"],
         "--source_image_column 'source_image' is not a dataset column"),
        (["--train_data_dir", pairs, "--vae_placement", "cache"], "editing pairs encode each step's source images"),
        (["--train_data_dir", pairs, "--validation_image", f"{pairs}/00000_source.png"],
         "--validation_image: Flux2KleinPipeline takes source images of 64 px a side or more"),
    ]  # fmt: skip
    for i, (flags, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        code, log = _run_in_process("train_text_to_image", [*common, *flags, "--output_dir", str(out)], capfd)
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (flags, log[-2000:])
        assert "Traceback" not in log
