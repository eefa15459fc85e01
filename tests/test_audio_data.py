"""LTX-2's audio data path (``data.audio``): reading a clip's sound, its log-mel spectrogram, its
length against the audio VAE and ``LTX2Pipeline``, and writing videos with sound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffusers_zero3.data.audio import (
    COLOUR_TONES,
    AudioSpec,
    audio_latent_frames,
    mel_spectrogram,
    read_audio,
    tone,
    write_tone_video,
    write_video_with_audio,
)
from diffusers_zero3.data.pixels import RowsToPixels
from diffusers_zero3.data.video import (
    ClipSampling,
    ShapeTones,
    VideoCaptionDataset,
    load_video_caption_dataset,
    write_shapes_videos,
    write_video,
)

pytestmark = pytest.mark.unit

SR = 16000
# the tiny LTX-2 pipeline's audio VAE (demo.pipelines)
VAE_CONFIG = dict(
    base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, in_channels=2, resolution=32,
    latent_channels=2, mel_bins=8,
)  # fmt: skip


def peak_hz(x: torch.Tensor, sample_rate: int) -> float:
    """The strongest frequency of a 1-D signal."""
    spectrum = np.abs(np.fft.rfft(x.numpy() * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * sample_rate / len(x)


@pytest.fixture(scope="module")
def two_tones(tmp_path_factory):
    """3 s of video at 8 fps with 440 Hz for 1.5 s, then 880 Hz."""
    path = tmp_path_factory.mktemp("tones") / "two.mp4"
    wave = tone(440, 3.0, SR)
    wave[:, int(1.5 * SR) :] = tone(880, 1.5, SR)
    frames = np.full((24, 32, 32, 3), 128, dtype=np.uint8)
    return write_video_with_audio(path, frames, 8, wave, SR), wave


def test_read_audio_length_rate_and_pitch(two_tones):
    path, _ = two_tones
    early = read_audio(path, 0.0, 1.0, 22050, 2)
    assert early.shape == (2, 22050) and early.dtype == torch.float32
    assert peak_hz(early[0], 22050) == pytest.approx(440, abs=2)
    late = read_audio(path, 2.0, 0.5, 22050, 2)  # a start past a second: the seeking path
    assert late.shape == (2, round(0.5 * 22050))
    assert peak_hz(late[1], 22050) == pytest.approx(880, abs=4)
    # the seeking path lands on the same samples as reading from the start (at the file's own rate)
    whole = read_audio(path, 0.0, 3.0, SR, 2)
    assert torch.equal(read_audio(path, 1.7, 1.0, SR, 2), whole[:, round(1.7 * SR) : round(1.7 * SR) + SR])
    # the switch is where it was written, to a hop
    around = read_audio(path, 1.4, 0.2, SR, 1)[0]
    assert peak_hz(around[: int(0.1 * SR) - 160], SR) == pytest.approx(440, abs=12)
    assert peak_hz(around[int(0.1 * SR) + 160 :], SR) == pytest.approx(880, abs=12)
    # a clip shorter than half an FFT window (1 frame at 60 fps) still gives its frame
    assert AudioSpec().clip_mel(path, 0.5, 1, 60)[0].shape == (2, 1, 64)
    # past the stream's end: zeros
    tail = read_audio(path, 2.5, 1.0, SR, 2)
    assert tail.shape == (2, SR) and tail[:, : SR // 2 - 1200].abs().max() > 0.2
    assert tail[:, SR // 2 + 1200 :].abs().max() == 0


def test_mono_becomes_stereo_and_stereo_stays(tmp_path):
    import av

    mono = tmp_path / "mono.mp4"
    with av.open(str(mono), "w") as container:
        stream = container.add_stream("aac", rate=SR)
        stream.codec_context.layout = "mono"
        samples = (tone(440, 1.0, SR) * 32767).to(torch.int16).numpy()
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = SR
        resampler = av.AudioResampler(format=stream.codec_context.format, layout="mono", rate=SR)
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            container.mux(stream.encode(f))
        container.mux(stream.encode())
    with av.open(str(mono)) as container:
        assert container.streams.audio[0].codec_context.channels == 1
    wave = read_audio(mono, 0.0, 0.5, SR, 2)
    assert wave.shape == (2, SR // 2) and torch.equal(wave[0], wave[1]) and wave.abs().max() > 0.2
    stereo = tmp_path / "stereo.mp4"
    both = torch.cat([tone(440, 1.0, SR), tone(880, 1.0, SR)])
    write_video_with_audio(stereo, np.zeros((8, 16, 16, 3), np.uint8), 8, both, SR)
    left, right = read_audio(stereo, 0.0, 0.5, SR, 2)
    assert peak_hz(left, SR) == pytest.approx(440, abs=4) and peak_hz(right, SR) == pytest.approx(880, abs=4)


def test_no_audio_stream_gives_none(tmp_path):
    path = write_video(tmp_path / "silent.mp4", np.zeros((9, 16, 16, 3), np.uint8), 8)
    assert read_audio(path, 0.0, 1.0, SR, 2) is None
    mel, has_audio = AudioSpec().clip_mel(path, 0.0, 9, 8)
    assert not has_audio and mel.shape == (2, AudioSpec().mel_frames(9, 8), 64) and not mel.any()


# ---------------------------------------------------------------------- the spectrogram


def numpy_log_mel(x, sr, n_fft, hop, n_mels, mel_scale):
    """LTX-2's ``AudioProcessor.waveform_to_mel`` written from its definition: a reflect-padded,
    periodic-Hann magnitude DFT per frame (one matrix product), triangular filters spaced evenly
    in mels between 0 and sr / 2, each scaled to unit area (Slaney), log of the floor 1e-5."""

    def to_mel(f):
        if mel_scale == "htk":
            return 2595 * np.log10(1 + f / 700)
        return f * 3 / 200 if f < 1000 else 15 + 27 * np.log(f / 1000) / np.log(6.4)

    def to_hz(m):
        if mel_scale == "htk":
            return 700 * (10 ** (m / 2595) - 1)
        return m * 200 / 3 if m < 15 else 1000 * np.exp((m - 15) * np.log(6.4) / 27)

    padded = np.pad(x, (n_fft // 2, n_fft // 2), mode="reflect")
    starts = range(0, len(padded) - n_fft + 1, hop)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    k = np.arange(n_fft // 2 + 1)
    dft = np.exp(-2j * np.pi * np.outer(np.arange(n_fft), k) / n_fft)
    mag = np.abs(np.stack([(padded[s : s + n_fft] * window) @ dft for s in starts]))  # (T, bins)
    edges = [to_hz(m) for m in np.linspace(to_mel(0.0), to_mel(sr / 2), n_mels + 2)]
    freqs = np.linspace(0, sr // 2, n_fft // 2 + 1)
    bank = np.zeros((len(freqs), n_mels))
    for j in range(n_mels):
        lo, mid, hi = edges[j : j + 3]
        for i, f in enumerate(freqs):
            if lo < f <= mid:
                bank[i, j] = (f - lo) / (mid - lo)
            elif mid < f < hi:
                bank[i, j] = (hi - f) / (hi - mid)
        bank[:, j] *= 2 / (hi - lo)
    return np.log(np.maximum(mag @ bank, 1e-5))


def test_mel_spectrogram_matches_the_definition():
    rng = np.random.default_rng(0)
    t = np.arange(4000) / SR
    x = (0.3 * np.sin(2 * np.pi * 523 * t) + 0.05 * rng.standard_normal(4000)).astype(np.float32)
    ours = mel_spectrogram(torch.from_numpy(np.stack([x, -x])))
    assert ours.shape == (2, 1 + 4000 // 160, 64)
    ref = numpy_log_mel(x.astype(np.float64), SR, 1024, 160, 64, "slaney")
    assert np.abs(ours[0].numpy() - ref).max() < 1e-4  # measured 4e-6; a symmetric Hann window: 5e-3
    assert torch.allclose(ours[0], ours[1])  # the magnitude of -x
    # other parameters give something else: the test can fail
    htk = numpy_log_mel(x.astype(np.float64), SR, 1024, 160, 64, "htk")
    assert np.abs(ours[0].numpy() - htk).max() > 0.1
    assert (
        np.abs(mel_spectrogram(torch.from_numpy(x[None]), AudioSpec(mel_scale="htk"))[0].numpy() - htk).max()
        < 1e-3
    )
    assert mel_spectrogram(torch.from_numpy(x[None]), AudioSpec(hop_length=200)).shape[1] != ours.shape[1]
    assert (mel_spectrogram(torch.from_numpy(x[None]), AudioSpec(norm=None))[0] - ours[0]).abs().max() > 1.0


# ---------------------------------------------------------------------- lengths and the dataset


def test_mel_frames_encode_to_the_pipelines_latent_frames():
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(**VAE_CONFIG).eval()
    spec = AudioSpec.from_audio_vae_config(dict(vae.config))
    assert (spec.sample_rate, spec.channels, spec.hop_length, spec.n_mels, spec.causal) == (
        SR,
        2,
        160,
        8,
        True,
    )
    for num_frames, rate in ((9, 8), (17, 24), (121, 24), (25, 25), (33, 7.5)):
        latents = audio_latent_frames(num_frames, rate, dict(vae.config))
        assert latents == round(num_frames / rate * SR / 160 / 4)  # LTX2Pipeline's audio_num_frames
        assert spec.mel_frames(num_frames, rate) == 4 * latents - 3
    with torch.no_grad():
        for num_frames, rate in ((9, 8), (17, 24)):  # 28 and 18 latent frames
            latents, frames = spec.latent_frames(num_frames, rate), spec.mel_frames(num_frames, rate)
            for t, expected in ((frames, latents), (frames + 3, latents), (frames - 1, latents - 1)):
                z = vae.encode(torch.randn(1, 2, t, 8)).latent_dist.mode()  # the causal encoder: ceil(T / 4)
                assert z.shape[2] == expected, (num_frames, rate, t)
        assert vae.decode(z).sample.shape[2] == frames - 4  # the decoder's 4L - 3, for L - 1 latents
    with pytest.raises(ValueError, match="compresses time by 2"):
        AudioSpec.from_audio_vae_config({**VAE_CONFIG, "ch_mult": (1, 2)})


def test_dataset_rows_carry_the_clips_sound(tmp_path):
    from diffusers import AutoencoderKLLTX2Audio

    folder = write_shapes_videos(
        tmp_path / "clips", num_clips=3, frames=17, tones=ShapeTones(SR, silent=(2,))
    )
    spec = AudioSpec.from_audio_vae_config(VAE_CONFIG)
    rows = load_video_caption_dataset(folder)

    def tokenize(captions):
        return {"input_ids": torch.zeros(len(captions), 4, dtype=torch.long)}

    data = VideoCaptionDataset(
        rows, RowsToPixels(resolution=32, tokenize=tokenize), ClipSampling(9), audio=spec
    )
    items = [data[i] for i in range(3)]
    latents = audio_latent_frames(9, 8, VAE_CONFIG)
    for item in items:
        assert item["audio_mel"].shape == (2, 4 * latents - 3, 8) and item["audio_mel"].dtype == torch.float32
        assert item["frame_rate"].item() == 8.0 and item["has_audio"].shape == ()
    assert [bool(item["has_audio"]) for item in items] == [True, True, False]
    assert not items[2]["audio_mel"].any()
    # the clip's own span of its track, as LTX-2 preprocesses it
    expected = spec.mel(read_audio(rows[0].clip, 0.0, 9 / 8, SR, 2))[:, : 4 * latents - 3]
    assert torch.equal(items[0]["audio_mel"], expected)
    # pitch: the row's tone (its colour) is loudest in the mel band that holds it
    colour = rows[0]["text"].split()[1]
    strongest = items[0]["audio_mel"][0].mean(0).argmax().item()
    band = spec.mel(tone(COLOUR_TONES[colour], 1.0, SR).expand(2, -1))[0].mean(0).argmax().item()
    assert strongest == band
    batch = torch.utils.data.default_collate(items)
    assert batch["audio_mel"].shape == (3, 2, 4 * latents - 3, 8) and batch["has_audio"].tolist() == [1, 1, 0]
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Audio(**VAE_CONFIG).eval()
    with torch.no_grad():
        assert vae.encode(batch["audio_mel"]).latent_dist.mode().shape[2] == latents
    # every other frame from a random start: 4 fps, the track from the first taken frame's time
    strided = VideoCaptionDataset(
        rows,
        RowsToPixels(resolution=32, tokenize=tokenize),
        ClipSampling(5, frame_stride=2, random_start=True),
        audio=spec,
    )
    starts = []
    for i in range(2):
        item = strided[i]
        assert item["frame_rate"].item() == 4.0 and item["audio_mel"].shape[1] == spec.mel_frames(5, 4.0)
        mels = [spec.clip_mel(rows[i].clip, s / 8, 5, 4.0)[0] for s in range(17 - 8)]
        matches = [s for s, mel in enumerate(mels) if torch.equal(mel, item["audio_mel"])]
        assert len(matches) == 1
        starts += matches
    assert any(starts), starts


def test_write_video_with_audio_round_trips(tmp_path):
    import av

    rng = np.random.default_rng(1)
    t = np.arange(SR) / SR
    wave = torch.from_numpy(
        np.stack([0.3 * np.sin(2 * np.pi * 300 * t + p) + 0.1 * np.sin(2 * np.pi * 1200 * t) for p in (0, 1)])
    ).float()
    frames = rng.integers(0, 255, (6, 16, 16, 3), dtype=np.uint8)
    for fps in (6, 7.5):  # a whole and a fractional rate (diffusers' encode_video truncates the latter)
        path = write_video_with_audio(tmp_path / f"clip-{fps}.mp4", frames, fps, wave, SR)
        back = read_audio(path, 0.0, 1.0, SR, 2)
        assert back.shape == wave.shape

        def relative_error(a, b):
            return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()

        assert relative_error(back, wave) < 0.03, fps  # AAC: lossy
        assert relative_error(back[:, 8:], wave[:, :-8]) > 0.1  # 8 samples late would show
        with av.open(str(path)) as container:
            video = container.streams.video[0]
            assert float(video.average_rate) == pytest.approx(fps) and video.frames == 6
    mono = write_tone_video(tmp_path / "tone.mp4", frames, 6, 500.0, 22050)
    back = read_audio(mono, 0.0, 1.0, 22050, 2)
    assert (back[0] - back[1]).abs().max() < 0.03 and peak_hz(back[0], 22050) == pytest.approx(500, abs=2)
    assert math.isclose(back.abs().max().item(), 0.3, abs_tol=0.02)
