"""Clips' sound for LTX-2: read a video file's audio track, turn it into the log-mel spectrogram
that LTX-2's audio VAE encodes, and write videos with sound.

The spectrogram is LTX-2's own preprocessing (Lightricks/LTX-2,
``packages/ltx-core/src/ltx_core/model/audio_vae/ops.py``, ``AudioProcessor``, used by
``packages/ltx-trainer/scripts/process_videos.py`` ``_encode_audio``): torchaudio's
``MelSpectrogram(sample_rate=16000, n_fft=1024, win_length=1024, hop_length=160, f_min=0,
f_max=sample_rate / 2, n_mels=64, window_fn=hann_window, center=True, pad_mode="reflect",
power=1.0, mel_scale="slaney", norm="slaney")``, then ``log(clamp(mel, min=1e-5))``,
as ``(channels, time, n_mels)``. torchaudio is not a dependency: ``mel_spectrogram`` writes it
out with ``torch.stft`` and the Slaney filterbank of ``torchaudio.functional.melscale_fbanks``.

Lengths: a clip of ``num_frames`` frames at ``frame_rate`` lasts ``num_frames / frame_rate``
seconds; ``LTX2Pipeline`` generates ``round(seconds * sample_rate / hop / 4)`` audio latent
frames for it (``audio_latent_frames``). The audio VAE's encoder is causal in time (two stride-2
convolutions padded 2 before, none after): ``T`` mel frames give ``ceil(T / 4)`` latent frames,
and its decoder gives ``4L - 3`` mel frames for ``L`` latents. A clip's spectrogram is therefore
cut (or padded with silence) to ``4L - 3`` frames (``AudioSpec.mel_frames``), so that encoding
gives exactly the pipeline's ``L``. (LTX-2's trainer keeps all ``1 + samples // hop`` frames,
which encode to one latent frame more than its pipeline generates for most clip lengths.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

LOG_FLOOR = 1e-5  # the reference's clamp before the log


# -------------------------------------------------------------------------------- the spectrogram


def hz_to_mel(freq: torch.Tensor, mel_scale: str = "slaney") -> torch.Tensor:
    """Hertz to mels (torchaudio's ``_hz_to_mel``): ``"htk"`` ``2595 log10(1 + f / 700)``;
    ``"slaney"`` linear below 1 kHz (``3 f / 200``), logarithmic above."""
    if mel_scale == "htk":
        return 2595.0 * torch.log10(1.0 + freq / 700.0)
    if mel_scale != "slaney":
        raise ValueError(f"mel_scale must be 'slaney' or 'htk', got {mel_scale!r}")
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(
        freq >= min_log_hz,
        min_log_mel + torch.log(freq.clamp(min=min_log_hz) / min_log_hz) / logstep,
        freq / f_sp,
    )


def mel_to_hz(mels: torch.Tensor, mel_scale: str = "slaney") -> torch.Tensor:
    """Mels to hertz, the inverse of ``hz_to_mel``."""
    if mel_scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    if mel_scale != "slaney":
        raise ValueError(f"mel_scale must be 'slaney' or 'htk', got {mel_scale!r}")
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(
        mels >= min_log_mel, min_log_hz * torch.exp(logstep * (mels - min_log_mel)), f_sp * mels
    )


def mel_filterbank(
    n_freqs: int,
    f_min: float,
    f_max: float,
    n_mels: int,
    sample_rate: int,
    norm: str | None = "slaney",
    mel_scale: str = "slaney",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Triangular mel filters ``(n_freqs, n_mels)`` in float64, as
    ``torchaudio.functional.melscale_fbanks`` (``norm="slaney"``: each filter scaled by
    ``2 / (its upper edge - its lower edge)`` in hertz)."""
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64, device=device)
    edges = torch.tensor([f_min, f_max], dtype=torch.float64, device=device)
    m_min, m_max = hz_to_mel(edges, mel_scale)
    f_pts = mel_to_hz(torch.linspace(m_min, m_max, n_mels + 2, dtype=torch.float64, device=device), mel_scale)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0.0)
    if norm == "slaney":
        fb = fb * (2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels])).unsqueeze(0)
    elif norm is not None:
        raise ValueError(f"norm must be 'slaney' or None, got {norm!r}")
    return fb


def mel_spectrogram(waveform: torch.Tensor, spec: AudioSpec | None = None) -> torch.Tensor:
    """LTX-2's log-mel spectrogram (see the module doc) of ``waveform`` ``(channels, samples)``
    at ``spec.sample_rate`` (an ``AudioSpec``; None: its defaults, LTX-2's 16 kHz, 1024-point
    FFT, hop 160, 64 mel bins): ``(channels, 1 + samples // hop_length, n_mels)`` float32, on
    the waveform's device. Magnitude (power 1) STFT with a periodic Hann window of ``n_fft``,
    centred with reflect padding (``samples`` must exceed ``n_fft // 2``), Slaney mel filters
    (``mel_scale``, ``norm``) from ``f_min`` to ``f_max`` (default ``sample_rate / 2``), then
    ``log(max(mel, 1e-5))``.

    Example:
        >>> mel_spectrogram(torch.zeros(2, 16000), AudioSpec(n_mels=80)).shape
        torch.Size([2, 101, 80])
    """
    s = spec or AudioSpec()
    sample_rate, n_fft, hop_length, n_mels = s.sample_rate, s.n_fft, s.hop_length, s.n_mels
    f_min, f_max, mel_scale, norm = s.f_min, s.f_max, s.mel_scale, s.norm
    if waveform.ndim != 2:
        raise ValueError(f"waveform must be (channels, samples), got shape {tuple(waveform.shape)}")
    if waveform.shape[-1] <= n_fft // 2:
        raise ValueError(f"waveform of {waveform.shape[-1]} samples is too short for n_fft {n_fft}")
    x = waveform.float()
    window = torch.hann_window(n_fft, periodic=True, device=x.device)
    spec = torch.stft(
        x,
        n_fft,
        hop_length,
        n_fft,
        window,
        center=True,
        pad_mode="reflect",
        onesided=True,
        return_complex=True,
    ).abs()  # (C, n_fft // 2 + 1, T)
    f_max = sample_rate / 2.0 if f_max is None else f_max
    fb = mel_filterbank(n_fft // 2 + 1, f_min, f_max, n_mels, sample_rate, norm, mel_scale, device=x.device)
    mel = torch.matmul(spec.transpose(-1, -2), fb.float())  # (C, T, n_mels)
    return torch.log(torch.clamp(mel, min=LOG_FLOOR))


# -------------------------------------------------------------------------------- lengths


def audio_latent_frames(num_frames: int, frame_rate: float, audio_vae_config: dict) -> int:
    """The audio latent frames ``LTX2Pipeline`` generates beside ``num_frames`` video frames at
    ``frame_rate``: ``round(num_frames / frame_rate * sample_rate / mel_hop_length / 4)``."""
    return AudioSpec.from_audio_vae_config(audio_vae_config).latent_frames(num_frames, frame_rate)


@dataclass(frozen=True)
class AudioSpec:
    """How a clip's sound is read for an audio VAE: resampled to ``sample_rate`` with
    ``channels`` channels, LTX-2's log-mel spectrogram (``mel_spectrogram`` reads these fields), and the
    VAE's ``temporal_compression`` (4) and causality (``causal``: time-causal encoder)."""

    sample_rate: int = 16000
    channels: int = 2
    n_fft: int = 1024
    hop_length: int = 160
    n_mels: int = 64
    f_min: float = 0.0
    f_max: float | None = None
    mel_scale: str = "slaney"
    norm: str | None = "slaney"
    temporal_compression: int = 4
    causal: bool = True

    @classmethod
    def from_audio_vae_config(cls, config: dict) -> AudioSpec:
        """The spec of an ``AutoencoderKLLTX2Audio`` config (``sample_rate``, ``mel_hop_length``,
        ``mel_bins``, ``in_channels``, ``causality_axis``; ``n_fft`` is LTX-2's 1024, which the
        diffusers config does not hold). ``ValueError`` for a VAE whose encoder does not
        compress time by 4 (``len(ch_mult) != 3``): ``LTX2Pipeline`` assumes 4."""
        ch_mult = config.get("ch_mult", (1, 2, 4))
        if 2 ** (len(ch_mult) - 1) != 4:
            raise ValueError(
                f"error: the audio VAE's ch_mult {tuple(ch_mult)} compresses time by {2 ** (len(ch_mult) - 1)}, "
                "but LTX2Pipeline assumes 4: give it 3 levels"
            )
        return cls(
            sample_rate=int(config.get("sample_rate", 16000)),
            channels=int(config.get("in_channels", 2)),
            hop_length=int(config.get("mel_hop_length", 160)),
            n_mels=int(config.get("mel_bins") or 64),
            causal=config.get("causality_axis", "height") == "height",
        )

    def latent_frames(self, num_frames: int, frame_rate: float) -> int:
        """``LTX2Pipeline``'s audio latent frames for ``num_frames`` frames at ``frame_rate``."""
        seconds = num_frames / float(frame_rate)
        return round(seconds * self.sample_rate / self.hop_length / float(self.temporal_compression))

    def mel_frames(self, num_frames: int, frame_rate: float) -> int:
        """Mel frames that encode to exactly ``latent_frames``: ``4L - 3`` for a time-causal VAE
        (what its decoder gives back), else ``4L``."""
        latents = max(1, self.latent_frames(num_frames, frame_rate))
        return self.temporal_compression * latents - (self.temporal_compression - 1 if self.causal else 0)

    def mel(self, waveform: torch.Tensor) -> torch.Tensor:
        """``mel_spectrogram`` of ``waveform`` ``(channels, samples)`` at this spec."""
        return mel_spectrogram(waveform, self)

    def clip_mel(
        self, path: str | os.PathLike | None, start_s: float, num_frames: int, frame_rate: float
    ) -> tuple[torch.Tensor, bool]:
        """The spectrogram of a clip's sound, ``(channels, mel_frames, n_mels)`` float32 on the CPU,
        and whether it has sound: ``num_frames / frame_rate`` seconds of ``path``'s audio from
        ``start_s``, cut or padded with silence (``log 1e-5``) to ``mel_frames``. A file without
        an audio stream (or ``path`` None: a frame folder) gives zeros and False."""
        frames = self.mel_frames(num_frames, frame_rate)
        waveform = None if path is None else (
            read_audio(path, start_s, num_frames / float(frame_rate), self.sample_rate, self.channels)
        )  # fmt: skip
        if waveform is None:
            return torch.zeros(self.channels, frames, self.n_mels), False  # CPU: data-loader side
        if waveform.shape[1] <= self.n_fft // 2:  # a clip shorter than half a window (one frame at 60 fps)
            waveform = torch.nn.functional.pad(waveform, (0, self.n_fft // 2 + 1 - waveform.shape[1]))
        mel = self.mel(waveform)[:, :frames]
        if mel.shape[1] < frames:
            mel = torch.nn.functional.pad(mel, (0, 0, 0, frames - mel.shape[1]), value=math.log(LOG_FLOOR))
        return mel.contiguous(), True


# -------------------------------------------------------------------------------- reading


def read_audio(
    path: str | os.PathLike, start_s: float, duration_s: float, sample_rate: int = 16000, channels: int = 2
) -> torch.Tensor | None:
    """``duration_s`` seconds of a media file's first audio stream from ``start_s``, resampled
    with PyAV (``av.AudioResampler``, FFmpeg's swresample) to ``sample_rate``: float32 in
    [-1, 1], ``(channels, round(duration_s * sample_rate))``; zero-padded where the stream ends
    early (or starts late). ``channels`` 2: a mono track is duplicated, a stereo one kept, more
    channels are downmixed by swresample; ``channels`` 1: downmixed. None when the file has no
    audio stream. Raises ``ValueError`` for a file PyAV cannot open."""
    import av

    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    total = round(duration_s * sample_rate)
    out = np.zeros((channels, total), dtype=np.float32)  # CPU: numpy buffer
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as e:
        raise ValueError(f"cannot open {Path(path).name} ({type(e).__name__}: {e})") from e
    with container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        source_channels = stream.codec_context.channels or 2
        layout = "mono" if channels == 1 or source_channels == 1 else "stereo"
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
        if start_s > 1.0 and stream.time_base:  # seek a second early: the decoder primes itself
            container.seek(int((start_s - 1.0) / stream.time_base), stream=stream, backward=True)
        first = round(start_s * sample_rate)  # the wanted span, in output samples from the file's start
        position = None  # output samples from the file's start of the next resampled sample

        def take(frames) -> bool:
            nonlocal position
            for frame in frames:
                data = frame.to_ndarray()  # (layout channels, samples)
                lo, hi = max(position, first), min(position + data.shape[1], first + total)
                if hi > lo:
                    out[:, lo - first : hi - first] = data[:, lo - position : hi - position]
                position += data.shape[1]
            return position >= first + total

        done = False
        for frame in container.decode(stream):
            if position is None:
                position = round(float(frame.time or 0.0) * sample_rate)
            if take(resampler.resample(frame)):
                done = True
                break
        if position is not None and not done:
            take(resampler.resample(None))
    return torch.from_numpy(out)


# -------------------------------------------------------------------------------- writing


def write_video_with_audio(
    path: str | os.PathLike, frames: np.ndarray, fps: float, waveform, sample_rate: int
) -> Path:
    """Write uint8 RGB frames ``(F, H, W, 3)`` (even sides) with ``waveform`` ``(channels,
    samples)`` float in [-1, 1] at ``sample_rate`` as an mp4 (H.264 yuv420p + stereo AAC; mono is
    duplicated), any ``fps`` (diffusers' ``encode_video``, the LTX-2 writer, truncates a
    fractional rate to an integer and prints a progress bar per file: the same codecs here)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    audio = torch.as_tensor(waveform).float().cpu()
    if audio.ndim == 1:
        audio = audio.unsqueeze(0)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2):
        raise ValueError(f"waveform must be (1 or 2 channels, samples), got shape {tuple(audio.shape)}")
    video = np.ascontiguousarray(frames)
    stereo = audio.expand(2, -1) if audio.shape[0] == 1 else audio
    samples = (stereo.clamp(-1, 1) * 32767.0).to(torch.int16).T.contiguous().reshape(1, -1).numpy()
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        sound = container.add_stream("aac", rate=int(sample_rate))
        sound.codec_context.layout = "stereo"
        for frame in video:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        frame_in = av.AudioFrame.from_ndarray(samples, format="s16", layout="stereo")
        frame_in.sample_rate = int(sample_rate)
        resampler = av.AudioResampler(
            format=sound.codec_context.format or "fltp", layout="stereo", rate=sample_rate
        )
        pts = 0
        for frame in [*resampler.resample(frame_in), *resampler.resample(None)]:
            frame.pts, pts = pts, pts + frame.samples
            container.mux(sound.encode(frame))
        container.mux(sound.encode())
    return path


COLOUR_TONES = {"red": 262.0, "green": 392.0, "blue": 587.0, "yellow": 880.0}  # the demo's pitch per colour


def tone(frequency: float, seconds: float, sample_rate: int, amplitude: float = 0.3) -> torch.Tensor:
    """A sine tone ``(1, round(seconds * sample_rate))`` float32."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return torch.from_numpy((amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)).unsqueeze(0)


def write_tone_video(
    path: str | os.PathLike, frames: np.ndarray, fps: float, frequency: float, sample_rate: int = 16000
) -> Path:
    """Write frames ``(F, H, W, 3)`` with a sine tone of ``frequency`` Hz lasting the clip
    (``F / fps`` seconds, mono written as stereo): ``write_video_with_audio``."""
    return write_video_with_audio(
        path, frames, fps, tone(frequency, len(frames) / fps, sample_rate), sample_rate
    )
