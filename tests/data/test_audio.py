"""`AudioProcessor` against transformers' Gemma 3n and Gemma 4 feature extractors on the same waveforms,
built from the same preprocessor_config.json; its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dew.data.audio import AudioProcessor

transformers = pytest.importorskip("transformers")

# Three clips of different lengths in one batch (the batch pads to the longest, rounded up to 128 samples):
# white noise with a tone, at 16 kHz. Per-bin statistics on one Gemma 3n case.
LENGTHS = (8_000, 5_003, 2_417)
CASES = {
    "gemma3n": ("Gemma3nAudioFeatureExtractor", {}),
    "gemma3n-per-bin": ("Gemma3nAudioFeatureExtractor", {"feature_size": 32, "preemphasis_htk_flavor": False}),
    "gemma4": ("Gemma4AudioFeatureExtractor", {}),
}


def _waveforms(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.normal(size=n) + 0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / 16_000)).astype(np.float32)
            for n in LENGTHS]


@pytest.fixture(scope="module", params=sorted(CASES))
def extractors(request, tmp_path_factory):
    """(transformers' extractor, Dew's built from the preprocessor_config.json it saves)."""
    name, fields = CASES[request.param]
    if request.param.endswith("per-bin"):
        rng = np.random.default_rng(1)
        fields = {**fields, "per_bin_mean": rng.normal(size=32).tolist(),
                  "per_bin_stddev": rng.uniform(0.5, 2, size=32).tolist()}
    reference = getattr(transformers, name)(**fields)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return reference, AudioProcessor.from_pretrained(directory)


# Both sides frame the same float32 samples and take numpy's float32 transform of the same float32 window;
# the float64 mel product may sum in another order (a few ulps of float64), which the last rounding to
# float32 turns into at most one float32 ulp of each value; the float64 mel points may differ by a library's
# log10 (one float64 ulp), another ulp at most. Bound: 2 ulps of each value. The largest difference
# observed: 0 (bit-identical) on every case.
def test_features_equal_transformers(extractors):
    reference, ours = extractors
    waveforms = _waveforms()
    theirs = reference(waveforms, return_tensors="np")
    features, mask = ours(waveforms, sampling_rate=16_000)
    assert features.dtype == np.float32 and mask.dtype == bool
    np.testing.assert_array_equal(mask, theirs["input_features_mask"])
    assert mask.sum(axis=1).tolist() != [mask.shape[1]] * 3  # the shorter clips' padding frames are masked
    expected = theirs["input_features"]
    assert features.shape == expected.shape
    bound = 2 * np.finfo(np.float32).eps * np.abs(expected)
    difference = np.abs(features.astype(np.float64) - expected)
    assert (difference <= bound).all(), difference.max()


def test_refusals(extractors):
    _, ours = extractors
    with pytest.raises(ValueError, match="sampled at 44100 Hz; this extractor reads 16000 Hz"):
        ours(_waveforms(), sampling_rate=44_100)
    with pytest.raises(ValueError, match=r"clip 1 has shape \(2, 100\); a waveform is mono"):
        ours([np.zeros(800, np.float32), np.zeros((2, 100), np.float32)])
    with pytest.raises(ValueError, match="clip 0 has 480,001 samples; this extractor reads 1 to 480,000"):
        ours([np.zeros(480_001, np.float32)])
    with pytest.raises(TypeError, match="non-empty list of waveforms"):
        ours(np.zeros(800, np.float32))
    with pytest.raises(ValueError, match="NaN or an infinity at sample 3"):
        ours([np.array([0, 0, 0, np.nan] * 200, np.float32)])


def test_config_refusals(tmp_path):
    record = json.loads(transformers.Gemma4AudioFeatureExtractor().to_json_string())
    assert AudioProcessor.from_config(record).kind == "gemma4"
    with pytest.raises(ValueError, match="dither 0.1"):
        AudioProcessor.from_config({**record, "dither": 0.1})
    with pytest.raises(ValueError, match="'window_type' = 'hamming' is not one"):
        AudioProcessor.from_config({**record, "window_type": "hamming"})
    with pytest.raises(ValueError, match="'WhisperFeatureExtractor' feature extractor"):
        AudioProcessor.from_config({**record, "feature_extractor_type": "WhisperFeatureExtractor"})
    with pytest.raises(ValueError, match="says fft_length 1024"):
        AudioProcessor.from_config({**record, "fft_length": 1024})
    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json"):
        AudioProcessor.from_pretrained(tmp_path)
