"""`AudioProcessor`: 16 kHz mono waveforms to the log-mel frames an audio tower reads (`dew.nn.audio`).

It is the checkpoint's feature extractor, built from its `preprocessor_config.json` (transformers'
`Gemma3nAudioFeatureExtractor` or `Gemma4AudioFeatureExtractor` record) and computed here in numpy:

- the clips of a batch padded with `padding_value` to the longest, rounded up to `pad_to_multiple_of`
  samples; a sample mask marks the real ones;
- frames of `frame_length` samples every `hop_length` (Gemma 4 first puts `frame_length // 2` zeros in front,
  so that the first frame is centred on the first sample), each with pre-emphasis where the config has it
  (HTK's flavour: the frame's first sample scaled by `1 - preemphasis`), times a periodic Hann window, its
  magnitude spectrum over `fft_length` points, projected onto `feature_size` triangular mel filters (HTK's
  mel scale, between `min_frequency` and `max_frequency`);
- the log of each mel energy (Gemma 3n: of the energy floored at `mel_floor`; Gemma 4: of the energy plus
  `mel_floor`), less `per_bin_mean` and over `per_bin_stddev` where the config gives them;
- a frame's mask: Gemma 3n, whether its first sample is real; Gemma 4, whether its last one is (and its
  features are zeroed where it is not).

Waveforms, frames, window and transform are float32, as the checkpoint's extractor computes them; the mel
projection and the log are float64; the features come out float32. Nothing is resampled: a clip at
another rate, or with more than one channel, is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# transformers' extractor classes and the framing each one is (the module says how they differ).
KINDS = {"Gemma3nAudioFeatureExtractor": "gemma3n", "Gemma4AudioFeatureExtractor": "gemma4"}
# Each kind's defaults for the fields its record may leave out (transformers' constructor defaults).
_DEFAULTS = {
    "gemma3n": dict(frame_length_ms=32.0, min_frequency=125.0, max_frequency=7600.0, preemphasis=0.97,
                    fft_overdrive=True, mel_floor=1e-5),
    "gemma4": dict(frame_length_ms=20.0, min_frequency=0.0, max_frequency=8000.0, preemphasis=0.0,
                   fft_overdrive=False, mel_floor=1e-3),
}
# Record keys that change nothing computed here: bookkeeping, and what every Dew batch does anyway (a mask is
# always returned, padding is always on the right).
_INERT = frozenset({"feature_extractor_type", "processor_class", "return_attention_mask", "padding_side",
                    "transformers_version", "_processor_class", "fft_length"})


class AudioFeatures(NamedTuple):
    """What `AudioProcessor` returns: `input_features` float32 `[clips, frames, feature_size]` and
    `input_features_mask` bool `[clips, frames]`, true at frames of real audio."""

    input_features: np.ndarray
    input_features_mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class AudioProcessor:
    """A checkpoint's audio feature extractor (see the module): `processor([waveform, ...])` gives
    `AudioFeatures` for mono waveforms at `sampling_rate` (float samples in [-1, 1], one clip each).
    `kind` is the framing, `"gemma3n"` or `"gemma4"`; lengths are in samples."""

    kind: str
    feature_size: int = 128
    sampling_rate: int = 16_000
    padding_value: float = 0.0
    frame_length: int = 512
    hop_length: int = 160
    fft_overdrive: bool = True
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    preemphasis_htk_flavor: bool = True
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-5
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_length: int = 480_000
    pad_to_multiple_of: int = 128

    def __post_init__(self):
        if self.kind not in _DEFAULTS:
            raise ValueError(f"kind is {self.kind!r}; Dew computes the feature extractors {sorted(_DEFAULTS)}")
        for field in ("feature_size", "sampling_rate", "frame_length", "hop_length", "max_length",
                      "pad_to_multiple_of"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} is {value!r}; it must be a positive integer")
        if not 0 <= self.min_frequency < self.max_frequency <= self.sampling_rate / 2:
            raise ValueError(f"the mel filters span {self.min_frequency} to {self.max_frequency} Hz; they must lie "
                             f"between 0 and half the sampling rate ({self.sampling_rate / 2} Hz), the lower first")
        if not self.mel_floor > 0:
            raise ValueError(f"mel_floor is {self.mel_floor!r}; it must be positive (the log of zero energy)")
        if not 0 <= self.preemphasis < 1:
            raise ValueError(f"preemphasis is {self.preemphasis!r}; it must lie in [0, 1)")
        for field in ("per_bin_mean", "per_bin_stddev"):
            value = getattr(self, field)
            if value is not None and len(value) != self.feature_size:
                raise ValueError(f"{field} has {len(value)} values for feature_size {self.feature_size}: one per bin")

    # ---- from a checkpoint ------------------------------------------------------------------

    @classmethod
    def from_config(cls, record: Mapping[str, Any], where: str = "preprocessor_config.json") -> "AudioProcessor":
        """The extractor a `preprocessor_config.json` record describes, transformers' defaults for absent fields;
        a field that would change the features and is not computed here is refused by name."""
        name = record.get("feature_extractor_type")
        if name not in KINDS:
            raise ValueError(f"{where} describes a {name!r} feature extractor; Dew computes {sorted(KINDS)}")
        kind, defaults = KINDS[name], _DEFAULTS[KINDS[name]]
        fields = {field.name for field in dataclasses.fields(cls)} - {"kind"}
        for key, value in record.items():
            if key not in fields and key not in _INERT and key not in defaults and key != "hop_length_ms" \
                    and not (key == "dither" and value == 0):
                if key == "dither":
                    raise ValueError(f"{where} has dither {value!r}: Dew's features are deterministic and add no "
                                     "noise; set dither to 0.0")
                raise ValueError(f"{where} field {key!r} = {value!r} is not one Dew's {name} computes: remove it if "
                                 "the checkpoint's features were made without it")
        values = {key: record[key] for key in fields if key in record}
        rate = values.get("sampling_rate", 16_000)
        for length in ("frame_length", "hop_length"):
            ms = record.get(f"{length}_ms", defaults.get(f"{length}_ms", 10.0))
            values.setdefault(length, int(round(rate * ms / 1000.0)))
        for key, value in defaults.items():
            if key in fields:
                values.setdefault(key, record.get(key, value))
        for key in ("per_bin_mean", "per_bin_stddev"):
            if values.get(key) is not None:
                values[key] = tuple(np.asarray(values[key], np.float64).reshape(-1).tolist())  # saved as [1, 1, F]
        try:
            processor = cls(kind, **values)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if "fft_length" in record and record["fft_length"] != processor.fft_length:
            raise ValueError(f"{where} says fft_length {record['fft_length']}; its frame_length "
                             f"{processor.frame_length} and fft_overdrive {processor.fft_overdrive} make "
                             f"{processor.fft_length}")
        return processor

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "AudioProcessor":
        """The extractor of a checkpoint directory: its `preprocessor_config.json`, or the `feature_extractor`
        record of its `processor_config.json`."""
        directory = Path(directory)
        path = directory / "preprocessor_config.json"
        if path.is_file():
            return cls.from_config(json.loads(path.read_text()), str(path))
        path = directory / "processor_config.json"
        record = json.loads(path.read_text()).get("feature_extractor") if path.is_file() else None
        if record is None:
            raise FileNotFoundError(f"{directory} holds no preprocessor_config.json (nor a processor_config.json "
                                    "with a feature_extractor record): the checkpoint has no audio feature extractor")
        return cls.from_config(record, f"{path} (feature_extractor)")

    # ---- the features ---------------------------------------------------------------------

    @property
    def fft_length(self) -> int:
        """The transform's points: the frame rounded up to a power of two, doubled with `fft_overdrive`."""
        return 2 ** math.ceil(math.log2(self.frame_length)) * (2 if self.fft_overdrive else 1)

    def __call__(self, audio: Sequence[Any], sampling_rate: int | None = None) -> AudioFeatures:
        """The features of `audio`, a list of mono waveforms (1-D arrays of float samples), one clip each, at
        `sampling_rate` (the extractor's when None; another is refused: resample first)."""
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"the audio is sampled at {sampling_rate} Hz; this extractor reads {self.sampling_rate} "
                             "Hz and resamples nothing: resample the waveforms first")
        if isinstance(audio, np.ndarray) or not isinstance(audio, Sequence) or not len(audio):
            raise TypeError("AudioProcessor takes a non-empty list of waveforms (1-D arrays), one per clip")
        clips = [self._waveform(index, clip) for index, clip in enumerate(audio)]
        length = max(len(clip) for clip in clips)
        length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        waveforms = np.full((len(clips), length), self.padding_value, np.float32)
        real = np.zeros((len(clips), length), bool)
        for row, clip in enumerate(clips):
            waveforms[row, :len(clip)], real[row, :len(clip)] = clip, True
        features, mask = zip(*(self._log_mel(waveform, samples) for waveform, samples in zip(waveforms, real)))
        return AudioFeatures(np.stack(features), np.stack(mask))

    def _waveform(self, index: int, clip) -> np.ndarray:
        samples = np.asarray(clip)
        if samples.ndim != 1:
            raise ValueError(f"clip {index} has shape {samples.shape}; a waveform is mono, one sample per time step "
                             "(1-D): mix the channels down first")
        if not (np.issubdtype(samples.dtype, np.floating) or np.issubdtype(samples.dtype, np.integer)):
            raise TypeError(f"clip {index} holds {samples.dtype} values; a waveform holds float samples")
        if not 0 < len(samples) <= self.max_length:
            raise ValueError(f"clip {index} has {len(samples):,} samples; this extractor reads 1 to "
                             f"{self.max_length:,} ({self.max_length / self.sampling_rate:g} s): cut longer audio into "
                             "several clips")
        if np.issubdtype(samples.dtype, np.floating) and not np.isfinite(samples).all():
            raise ValueError(f"clip {index} holds a NaN or an infinity at sample "
                             f"{int(np.argmin(np.isfinite(samples)))}: a waveform holds finite samples")
        return samples.astype(np.float32)

    def _log_mel(self, waveform: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One padded clip's features `[frames, feature_size]` and frame mask."""
        # python floats scale float32 arrays in float32, as the reference's arithmetic does
        if self.input_scale_factor != 1.0:
            waveform = waveform * float(self.input_scale_factor)
        if self.kind == "gemma4":  # the first frame centred on the first sample
            waveform = np.concatenate([np.zeros(self.frame_length // 2, np.float32), waveform])
            real = np.concatenate([np.zeros(self.frame_length // 2, bool), real])
        span = self.frame_length + 1  # one sample more than a frame: pre-emphasis reads the one before
        count = (len(waveform) - span) // self.hop_length + 1
        if count < 1:
            raise ValueError(f"the batch's longest clip gives {len(waveform)} samples, fewer than one frame "
                             f"({span}): give clips of at least {span} samples")
        starts = np.arange(count) * self.hop_length
        windows = waveform[starts[:, None] + np.arange(span)[None]]  # [frames, span]
        p = float(self.preemphasis)
        if self.preemphasis > 0 and self.preemphasis_htk_flavor:
            frames = np.concatenate([windows[:, :1] * (1.0 - p), windows[:, 1:-1] - p * windows[:, :-2]], axis=1)
        elif self.preemphasis > 0:
            frames = windows[:, 1:] - p * windows[:, :-1]
        else:
            frames = windows[:, :-1]
        magnitudes = np.abs(np.fft.rfft(frames * self._window(), n=self.fft_length, axis=-1))
        energies = magnitudes @ self._mel_filters()
        if self.kind == "gemma3n":
            features = np.log(np.maximum(energies, self.mel_floor))
        else:
            features = np.log(energies + self.mel_floor)
        if self.per_bin_mean is not None:
            features = features - np.asarray(self.per_bin_mean)
        if self.per_bin_stddev is not None:
            features = features / np.asarray(self.per_bin_stddev)
        features = features.astype(np.float32)
        if self.kind == "gemma3n":
            return features, real[starts]
        mask = real[starts + self.frame_length]
        return features * mask[:, None], mask

    def _window(self) -> np.ndarray:
        """The periodic Hann window of a frame, float32: Gemma 3n's evaluated in float32, Gemma 4's in float64
        (numpy's `hanning` over one more point, the last dropped) and rounded, as each extractor does."""
        n = self.frame_length
        if self.kind == "gemma3n":
            return (0.5 * (1 - np.cos(2 * np.pi * np.arange(n, dtype=np.float32) / n))).astype(np.float32)
        return np.hanning(n + 1)[:-1].astype(np.float32)

    def _mel_filters(self) -> np.ndarray:
        """`[fft_length // 2 + 1, feature_size]` float64 triangles over the transform's bins: filter m rises from
        mel point m to m + 1 and falls to m + 2, the `feature_size + 2` points evenly spaced on HTK's mel scale.
        The bins' frequencies: Gemma 3n's `k * rate / fft_length` in float32, Gemma 4's evenly from 0 to half
        the rate in float64, as each extractor places them."""
        bins = self.fft_length // 2 + 1
        if self.kind == "gemma3n":
            frequencies = np.arange(bins, dtype=np.float32) * np.float32(self.sampling_rate / self.fft_length)
        else:
            frequencies = np.linspace(0, self.sampling_rate // 2, bins)
        mel = lambda hz: 2595.0 * np.log10(1.0 + hz / 700.0)
        points = 700.0 * (10 ** (np.linspace(mel(self.min_frequency), mel(self.max_frequency),
                                             self.feature_size + 2) / 2595.0) - 1.0)
        widths = np.diff(points)
        to_points = points[None, :] - frequencies.astype(np.float64)[:, None]  # [bins, feature_size + 2]
        rising = -to_points[:, :-2] / widths[:-1]
        falling = to_points[:, 2:] / widths[1:]
        return np.maximum(0.0, np.minimum(rising, falling))


__all__ = ["KINDS", "AudioFeatures", "AudioProcessor"]
