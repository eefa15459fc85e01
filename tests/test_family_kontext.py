"""The Flux.1 Kontext family against ``FluxKontextPipeline`` and diffusers'
``train_dreambooth_lora_flux_kontext.py``: prompt encoding against ``encode_prompt``, the
transformer call (the target's tokens, then the source's with first position id 1; the
prediction of the target's tokens) against the pipeline's, captured with a forward hook, in
fp32 and bf16; the objective against the script's lines; several sources side by side as one
stitched source; the paired data (a pair folder, its errors, one crop and flip per pair)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = ["make the circle blue", "turn the red square into a green one, keep the background"]


@pytest.fixture(scope="module")
def folder(tiny_kontext):
    return tiny_kontext[0]


def load(folder, dtype=torch.float32):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def conditioning(pipe, folder, prompts, dtype=torch.float32):
    from diffusers_zero3.families import KONTEXT
    from diffusers_zero3.placement.frozen_inputs import conditioning_on

    ids = KONTEXT.tokenize(KONTEXT.load_tokenizers(folder), prompts, 16)
    with torch.no_grad():
        outputs = KONTEXT.encode_texts(
            {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}, ids
        )
    return conditioning_on(KONTEXT, outputs, torch.device("cpu"), dtype)


class Capture:
    """Keyword inputs and first outputs of every call of a module (a forward hook)."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        kept = {k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)}
        self.calls.append((kept, output[0].detach().clone()))

    def close(self):
        self.handle.remove()


def test_conditioning_equals_the_pipelines_encode_prompt(folder):
    from diffusers_zero3.families import KONTEXT, detect_family

    assert detect_family(folder) is KONTEXT and KONTEXT.edits
    pipe = load(folder)
    cond = conditioning(pipe, folder, PROMPTS)
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS, PROMPTS, device="cpu", max_sequence_length=16)
    torch.testing.assert_close(cond["encoder_hidden_states"], embeds, rtol=0, atol=0)
    torch.testing.assert_close(cond["pooled_projections"], pooled, rtol=0, atol=0)
    assert embeds.shape[1] == 16 and torch.equal(text_ids, torch.zeros(16, 3))


def source_latents_of(pipe, pixels):
    """The family's source latents (``FrozenInputs.source_latents``: the VAE's mode, normalised)."""
    from diffusers_zero3.families import KONTEXT

    normalize = KONTEXT.latent_normalizer(dict(pipe.vae.config))
    return normalize(KONTEXT.latent_distribution(pipe.vae, pixels).mode())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predict_is_the_pipelines_transformer_call(folder, dtype):
    """The pipeline edits a 32x48 source into a 32x32 target (2 steps): its every transformer call
    is ``KONTEXT.predict``'s on the same noisy target and the family's source latents (hidden
    states, image ids with the source's first coordinate 1, text ids, guidance, embeddings); the
    output equal in fp32, close in bf16 (the pipeline rounds ``t / 1000`` to bf16)."""
    from PIL import Image

    from diffusers_zero3.families import KONTEXT
    from diffusers_zero3.families.flux import latent_image_ids, pack_latents, unpack_latents

    pipe = load(folder, dtype)
    pipeline = KONTEXT.prepare_validation_pipeline(pipe, 32)
    rng = torch.Generator().manual_seed(0)
    source = Image.fromarray((torch.rand(32, 48, 3, generator=rng) * 255).to(torch.uint8).numpy())
    capture = Capture(pipe.transformer)
    with torch.no_grad():
        pipeline(image=source, prompt=PROMPTS[0], height=32, width=32, num_inference_steps=2, guidance_scale=2.5,
                 max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    calls, capture.calls = capture.calls, []
    assert len(calls) == 2
    cond = conditioning(pipe, folder, PROMPTS[:1], dtype)
    pixels = pipe.image_processor.preprocess(source, 32, 48).to(dtype)
    with torch.no_grad():
        cond["source_latents"] = source_latents_of(pipe, pixels).to(dtype).unsqueeze(1)  # (N, K=1, C, h, w)
    h, w, target_tokens = 16, 16, 64  # the tiny VAE downsamples 2x
    for (kwargs, expected), t in zip(calls, pipe.scheduler.timesteps):
        assert kwargs["hidden_states"].shape[1] == target_tokens + 8 * 12
        noisy = unpack_latents(kwargs["hidden_states"][:, :target_tokens], h, w)
        with torch.no_grad():
            ours = KONTEXT.predict(pipe.transformer, noisy, t.expand(1), cond, guidance_scale=2.5)
        ((our_kwargs, _),) = capture.calls
        capture.calls = []
        for key in (
            "hidden_states",
            "img_ids",
            "txt_ids",
            "guidance",
            "encoder_hidden_states",
            "pooled_projections",
        ):
            assert torch.equal(our_kwargs[key], kwargs[key]), key
        source_ids = latent_image_ids(16, 24, dtype=dtype)
        source_ids[:, 0] = 1
        assert torch.equal(our_kwargs["img_ids"][target_tokens:], source_ids)
        assert torch.equal(our_kwargs["img_ids"][:target_tokens], latent_image_ids(h, w, dtype=dtype))
        assert torch.equal(
            our_kwargs["hidden_states"][:, target_tokens:], pack_latents(cond["source_latents"][:, 0])
        )
        exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=8e-3, atol=0)
        torch.testing.assert_close(our_kwargs["timestep"], kwargs["timestep"].float(), **exact)
        assert ours.shape == (1, 16, h, w) and ours.dtype == dtype
        close = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(ours, unpack_latents(expected[:, :target_tokens], h, w), **close)
    capture.close()


def test_two_sources_sit_side_by_side_as_one_stitched_source(folder):
    """K = 2 sources give the prediction of their latents stitched left to right as one source
    (the same tokens and position ids, in another order): the pipeline's input for the stitched
    image. The order of the sources matters."""
    from diffusers import FluxKontextPipeline

    from diffusers_zero3.families import KONTEXT
    from diffusers_zero3.families.flux import latent_image_ids, pack_latents, unpack_latents

    pipe = load(folder)
    cond = conditioning(pipe, folder, PROMPTS[:1])
    g = torch.Generator().manual_seed(1)
    noisy, a, b = (torch.randn(1, 16, 8, 8, generator=g) for _ in range(3))
    t = torch.tensor([600.0])
    with torch.no_grad():
        ours = KONTEXT.predict(pipe.transformer, noisy, t, {**cond, "source_latents": torch.stack([a, b], 1)})
        swapped = KONTEXT.predict(
            pipe.transformer, noisy, t, {**cond, "source_latents": torch.stack([b, a], 1)}
        )
        stitched = torch.cat([a, b], dim=-1)  # (1, 16, 8, 16)
        ids = latent_image_ids(8, 16)
        ids[:, 0] = 1
        expected = pipe.transformer(
            hidden_states=torch.cat([pack_latents(noisy), FluxKontextPipeline._pack_latents(stitched, 1, 16, 8, 16)], 1),
            timestep=t / 1000, guidance=torch.full((1,), 3.5), pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=cond["encoder_hidden_states"], txt_ids=torch.zeros(16, 3),
            img_ids=torch.cat([latent_image_ids(8, 8), ids]), return_dict=False,
        )[0]  # fmt: skip
    torch.testing.assert_close(ours, unpack_latents(expected[:, :16], 8, 8), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, swapped, atol=1e-4)


def test_frozen_inputs_encode_each_source_as_the_pipeline(folder):
    """``FrozenInputs`` gives a batch's K sources per sample as ``cond["source_latents"]`` ``(N, K,
    C, h, w)``: each the VAE's mode, normalised, as ``FluxKontextPipeline._encode_vae_image``."""
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.families import KONTEXT
    from diffusers_zero3.placement.frozen_inputs import ComponentFolders, FrozenInputs

    pipe = load(folder)
    inputs = FrozenInputs(
        KONTEXT, {"vae": pipe.vae, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}, None,
        normalize_latents=KONTEXT.latent_normalizer(dict(pipe.vae.config)), dtype=torch.float32,
        pixels=RowsToPixels(resolution=32), sources=ComponentFolders(),
    )  # fmt: skip
    ids = KONTEXT.tokenize(KONTEXT.load_tokenizers(folder), PROMPTS, 16)
    sources = torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    batch = {
        **ids,
        "pixel_values": sources[:, 0],
        "source_pixel_values": sources,
        "index": torch.tensor([0, 1]),
    }
    _, cond, _ = inputs(batch, torch.device("cpu"))
    assert cond["source_latents"].shape == (2, 2, 16, 16, 16)
    with torch.no_grad():
        for k in range(2):
            expected = pipe._encode_vae_image(sources[:, k], generator=None)
            torch.testing.assert_close(cond["source_latents"][:, k], expected, rtol=1e-5, atol=1e-5)


def script_loss(
    transformer, scheduler, model_input, cond_model_input, prompt_embeds, pooled, text_ids, scheme, seed
):
    """``train_dreambooth_lora_flux_kontext.py``'s step (diffusers 58eb52c0, lines 1945-1954
    ``get_sigmas``, 2036-2147 the loss with ``has_image_input``), after its latents
    (``--vae_encode_mode mode``), ``--guidance_scale 3.5``, with the RNG seeded as given."""
    from diffusers import FluxKontextPipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    noise_scheduler_copy = copy.deepcopy(scheduler)
    weight_dtype = model_input.dtype

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    vae_scale_factor = 2  # the tiny VAE's 2 ** (len(block_out_channels) - 1)
    latent_image_ids = FluxKontextPipeline._prepare_latent_image_ids(
        model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, "cpu", weight_dtype
    )
    cond_latents_ids = FluxKontextPipeline._prepare_latent_image_ids(
        cond_model_input.shape[0],
        cond_model_input.shape[2] // 2,
        cond_model_input.shape[3] // 2,
        "cpu",
        weight_dtype,
    )
    cond_latents_ids[..., 0] = 1
    latent_image_ids = torch.cat([latent_image_ids, cond_latents_ids], dim=0)
    torch.manual_seed(seed)
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(
        weighting_scheme=scheme, batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
    )
    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed_noisy_model_input = FluxKontextPipeline._pack_latents(
        noisy_model_input, batch_size=model_input.shape[0], num_channels_latents=model_input.shape[1],
        height=model_input.shape[2], width=model_input.shape[3],
    )  # fmt: skip
    orig_inp_shape = packed_noisy_model_input.shape
    packed_cond_input = FluxKontextPipeline._pack_latents(
        cond_model_input, batch_size=cond_model_input.shape[0], num_channels_latents=cond_model_input.shape[1],
        height=cond_model_input.shape[2], width=cond_model_input.shape[3],
    )  # fmt: skip
    packed_noisy_model_input = torch.cat([packed_noisy_model_input, packed_cond_input], dim=1)
    guidance = torch.tensor([3.5]).expand(model_input.shape[0])
    model_pred = transformer(
        hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
        pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=text_ids,
        img_ids=latent_image_ids, return_dict=False,
    )[0]  # fmt: skip
    model_pred = model_pred[:, : orig_inp_shape[1]]
    model_pred = FluxKontextPipeline._unpack_latents(
        model_pred, height=model_input.shape[2] * vae_scale_factor, width=model_input.shape[3] * vae_scale_factor,
        vae_scale_factor=vae_scale_factor,
    )  # fmt: skip
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1
    )
    return loss.mean()


@pytest.mark.parametrize(
    "scheme,dtype", [("none", torch.float32), ("logit_normal", torch.float32), ("none", torch.bfloat16)]
)
def test_objective_is_the_training_scripts(folder, scheme, dtype):
    """The family's target and source latents (the VAE's mode, shifted and scaled: the script's
    lines 2026-2034) and its loss equal the script's, to the bit."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers_zero3.families import KONTEXT
    from diffusers_zero3.families.objectives import ObjectiveSettings

    pipe = load(folder, dtype)
    vae, transformer = pipe.vae, pipe.transformer
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    cond = conditioning(pipe, folder, PROMPTS, dtype)
    torch.manual_seed(0)
    pixels, source_pixels = ((torch.rand(2, 3, 32, 32) * 2 - 1).to(dtype) for _ in range(2))
    with torch.no_grad():
        normalize = KONTEXT.latent_normalizer(dict(vae.config))
        latents = normalize(KONTEXT.latents_of(KONTEXT.latent_distribution(vae, pixels))).to(dtype)
        sources = source_latents_of(pipe, source_pixels).to(dtype)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
        model_input = ((vae.encode(pixels).latent_dist.mode() - shift) * scale).to(dtype=dtype)
        cond_model_input = ((vae.encode(source_pixels).latent_dist.mode() - shift) * scale).to(dtype=dtype)
    torch.testing.assert_close(latents, model_input, rtol=0, atol=0)
    torch.testing.assert_close(sources, cond_model_input, rtol=0, atol=0)
    with torch.no_grad():
        torch.manual_seed(123)
        ours = KONTEXT.loss(
            transformer, scheduler, model_input, {**cond, "source_latents": sources.unsqueeze(1)},
            ObjectiveSettings(weighting_scheme=scheme, guidance_scale=3.5),
        )  # fmt: skip
        expected = script_loss(
            transformer, scheduler, model_input, cond_model_input, cond["encoder_hidden_states"],
            cond["pooled_projections"], torch.zeros(16, 3, dtype=dtype), scheme, seed=123,
        )  # fmt: skip
        torch.manual_seed(123)
        without = KONTEXT.loss(
            transformer, scheduler, model_input, cond, ObjectiveSettings(weighting_scheme=scheme)
        )
    assert expected.item() > 0.1
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert ours != without  # the source reaches the prediction


# --------------------------------------------------------------------------- paired data


def test_pair_folder_layout_and_its_errors(tmp_path, tiny_kontext):
    import shutil

    from diffusers_zero3.data.images import prepare_image_column
    from diffusers_zero3.data.pairs import (
        PairedImageDataset,
        check_source_column,
        load_edit_dataset,
        read_pair_folder,
    )
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.errors import DataError

    data = tiny_kontext[1]
    ds = load_edit_dataset(None, None, data, None)
    assert ds.column_names == ["image", "source_image", "text"] and len(ds) == 8
    assert ds[0]["text"].startswith("make the ") and ds[0]["source_image"][0].endswith("00000_source.png")
    assert check_source_column(ds, "source_image") == 1
    with pytest.raises(DataError, match="--source_image_column 'cond' is not a dataset column"):
        check_source_column(ds, "cond")

    two = tmp_path / "two"  # NAME_source_0 / _1: two sources per target, in order
    two.mkdir()
    for name in ("a.png", "a.txt"):
        shutil.copy(f"{data}/00000{name[1:]}", two / name)
    shutil.copy(f"{data}/00000_source.png", two / "a_source_1.png")
    shutil.copy(f"{data}/00001_source.png", two / "a_source_0.png")
    (pair,) = read_pair_folder(two)
    assert [p.rsplit("/", 1)[1] for p in pair["sources"]] == ["a_source_0.png", "a_source_1.png"]
    rows = prepare_image_column(load_edit_dataset(None, None, str(two), None), "image")
    assert check_source_column(rows, "source_image") == 2
    item = PairedImageDataset(
        rows, RowsToPixels(resolution=32, tokenize=lambda c: {"input_ids": torch.zeros(1, 4)})
    )[0]
    assert item["source_pixel_values"].shape == (2, 3, 32, 32)
    assert not torch.equal(item["source_pixel_values"][0], item["source_pixel_values"][1])

    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    (broken / "00003_source.png").unlink()
    with pytest.raises(DataError, match="00003.png has no source image 00003_source.png"):
        read_pair_folder(broken)
    shutil.copy(f"{data}/00003_source.png", broken / "00003_source.png")
    (broken / "00005.txt").unlink()
    with pytest.raises(DataError, match="00005.png has no instruction file 00005.txt"):
        read_pair_folder(broken)
    # a path column naming a missing file
    rows = ds.map(lambda r: {"source_image": [r["source_image"][0].replace("00002_", "99999_")]})
    with pytest.raises(DataError, match="1 source image\\(s\\) missing, e.g. .*99999_source.png"):
        check_source_column(rows, "source_image")


def test_a_pair_is_cropped_and_flipped_as_one(tiny_kontext):
    """Sources take their target's resize, crop and flip (``transform_like``; the target's own
    pixels for the target itself), at its aspect-ratio bucket; a source of another size is
    resized to the target's size first."""
    from PIL import Image

    from diffusers_zero3.data.images import prepare_image_column, transform_image_with_crop
    from diffusers_zero3.data.pairs import PairedImageDataset, load_edit_dataset, transform_like
    from diffusers_zero3.data.pixels import RowsToPixels

    image = Image.fromarray((torch.rand(5, 7, 3, generator=torch.Generator().manual_seed(0)) * 255)
                            .to(torch.uint8).numpy()).resize((56, 40), Image.BICUBIC)  # smooth  # fmt: skip
    for seed in range(6):
        pixels, crop = transform_image_with_crop(image, (32, 32), False, True, random.Random(seed))
        assert torch.equal(transform_like(image, crop), pixels)
    assert {transform_image_with_crop(image, 32, False, True, random.Random(s))[1].flipped for s in range(6)} == {
        True, False}  # fmt: skip
    # a source at twice the size lands on the same pixels, up to the resize filter
    big = image.resize((112, 80), Image.BILINEAR)
    assert (transform_like(big, crop) - pixels).abs().mean() < 0.05
    assert (transform_like(big.transpose(Image.FLIP_LEFT_RIGHT), crop) - pixels).abs().mean() > 0.3

    ds = load_edit_dataset(None, None, tiny_kontext[1], None)
    ds = prepare_image_column(ds, "image")
    paired = PairedImageDataset(
        ds,
        RowsToPixels(
            resolution=32,
            center_crop=False,
            random_flip=True,
            seed=0,
            tokenize=lambda c: {"input_ids": torch.zeros(len(c), 4)},
            buckets=[(32, 32), (16, 32)],
            row_buckets=[1] * 8,
        ),
    )
    for epoch in range(2):
        paired.set_epoch(epoch)
        item = paired[3]
        assert item["pixel_values"].shape == (3, 16, 32) and item["source_pixel_values"].shape == (
            1,
            3,
            16,
            32,
        )
        # the shapes share their position: where the target differs from the background, so does the source
        background = item["pixel_values"].new_tensor([235 / 127.5 - 1] * 3).view(3, 1, 1)
        moved = (item["pixel_values"] - background).abs().sum(0) > 0.2
        moved_source = (item["source_pixel_values"][0] - background).abs().sum(0) > 0.2
        assert (moved == moved_source).float().mean() > 0.95


def test_a_source_column_holds_an_image_or_a_list_of_images():
    """A source cell is one image or a list of them (``datasets.List(Image())``): K sources per
    row, each its own ``source_pixel_values`` entry; rows with different K are one error."""
    import datasets

    from diffusers_zero3.data.pairs import PairedImageDataset, check_source_column
    from diffusers_zero3.data.pixels import RowsToPixels
    from diffusers_zero3.demo import png_value, shape_image
    from diffusers_zero3.errors import DataError

    red, blue, green = (png_value(shape_image(c, "circle")) for c in ("red", "blue", "green"))
    features = {"image": datasets.Image(), "text": datasets.Value("string")}
    one = datasets.Dataset.from_dict(
        {"image": [red] * 2, "src": [blue] * 2, "text": ["x"] * 2},
        features=datasets.Features({**features, "src": datasets.Image()}),
    )
    many = datasets.Dataset.from_dict(
        {"image": [red] * 2, "src": [[blue, green]] * 2, "text": ["x"] * 2},
        features=datasets.Features({**features, "src": datasets.List(datasets.Image())}),
    )
    uneven = datasets.Dataset.from_dict(
        {"image": [red] * 2, "src": [[blue], [blue, green]], "text": ["x"] * 2},
        features=datasets.Features({**features, "src": datasets.List(datasets.Image())}),
    )
    assert check_source_column(one, "src") == 1 and check_source_column(many, "src") == 2
    with pytest.raises(
        DataError, match="every row needs the same number of source images \\(found \\[1, 2\\]\\)"
    ):
        check_source_column(uneven, "src")
    tokenize = lambda c: {"input_ids": torch.zeros(len(c), 4)}  # noqa: E731
    for ds, k in ((one, 1), (many, 2)):
        item = PairedImageDataset(ds, RowsToPixels(resolution=32, tokenize=tokenize), source_column="src")[1]
        assert item["source_pixel_values"].shape == (k, 3, 32, 32)
    item = PairedImageDataset(many, RowsToPixels(resolution=32, tokenize=tokenize), source_column="src")[0]
    assert (
        item["source_pixel_values"][0, 2].mean() > item["source_pixel_values"][1, 2].mean()
    )  # blue, then green
