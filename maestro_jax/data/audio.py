"""Audio files -> the log-mel frames Whisper's encoder (and the omni workload's audio section) reads.

`log_mel` is Whisper's front end (`transformers.WhisperFeatureExtractor`) in numpy: 16 kHz mono
samples, a periodic Hann window of 400 samples (25 ms) every 160 (10 ms), centred (the clip
reflect-padded by 200 each side), the power spectrum through a Slaney-scale, Slaney-normalised
mel filterbank (0 to 8 kHz), log10 (floor 1e-10), the last frame dropped, each value clamped to
at least the clip's maximum - 8, then (x + 4) / 4. Unlike the extractor's default, a clip is not
padded to 30 s: the encoder takes clips of any length (models/audio.py). tests/test_convert.py
checks it against the extractor's output, stored by scripts/make_hf_fixtures.py.

`read_audio` reads WAV with the standard library's `wave` (integer PCM, 8 to 32 bits, channels
averaged to mono); it does not resample: a clip at another rate is refused, so no feature is
silently computed at the wrong rate.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160


class AudioError(ValueError):
    """An audio file that cannot become frames; the message says which and why."""


def _hz_to_mel(f):
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    f = np.asarray(f, np.float64)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, 3.0 * f / 200.0)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """[1 + n_fft / 2, n_mels]: triangles evenly spaced in mels from 0 Hz to the Nyquist rate,
    each scaled to unit area in Hz (Slaney's norm)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    bins = np.linspace(0, sample_rate // 2, 1 + n_fft // 2)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None]


def log_mel(samples: np.ndarray, n_mels: int) -> np.ndarray:
    """16 kHz mono samples -> Whisper's log-mel frames [len // 160, n_mels] (float32)."""
    x = np.asarray(samples, np.float64)
    if x.ndim != 1 or len(x) <= N_FFT // 2:
        raise AudioError(f"{len(x)} samples: a clip needs more than {N_FFT // 2} mono samples")
    x = np.pad(x, N_FFT // 2, mode="reflect")
    window = np.hanning(N_FFT + 1)[:-1]  # periodic
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP] * window
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    mel = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10))[:-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)


def read_audio(source: str | Path | BinaryIO, name: str | None = None) -> np.ndarray:
    """A WAV file's (or open binary stream's) samples, mono, in [-1, 1) (float32); AudioError,
    naming it (`name`, else the path), for one that is not readable integer PCM at 16 kHz."""
    path = name or str(source)
    try:
        with wave.open(source if hasattr(source, "read") else str(source), "rb") as w:
            rate, width, channels, n = w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes()
            raw = w.readframes(n)
    except (OSError, EOFError, wave.Error) as err:
        raise AudioError(f"{path}: not a readable WAV file ({err}); valid: integer PCM WAV") from None
    if rate != SAMPLE_RATE:
        raise AudioError(f"{path}: sample rate {rate} Hz; valid: {SAMPLE_RATE} Hz (Whisper's), resample it first")
    if width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit little-endian: widen each sample to 32 bits
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        x = b[:, 0].astype(np.int32) | b[:, 1].astype(np.int32) << 8 | b[:, 2].astype(np.int8).astype(np.int32) << 16
        x = x.astype(np.float32) / float(1 << 23)
    else:
        x = np.frombuffer(raw, {2: "<i2", 4: "<i4"}[width]).astype(np.float32) / float(1 << (8 * width - 1))
    return x.reshape(-1, channels).mean(axis=1) if channels > 1 else x
