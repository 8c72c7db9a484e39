"""Three-axis rotary positions (Qwen's M-RoPE): the tables in both layouts against transformers', the host's
positions against transformers' `get_rope_index`, and a Qwen 3.5 text decoder reading them, at prefill and
through cached decode, against transformers' on the same weights."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.rotary_positions import three_axis_positions
from dew.interop import load_pretrained
from dew.nn.rotary import RopeScaling, apply_rotary, rotary_angles
from tests.interop.test_qwen3_next import bound as hybrid_bound
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

MERGE = 2
# Three rows: two images of different grids and text between; one image; text then a wide image, then text.
# (is an image slot, grid) runs per row, in order; text runs are counts.
ROWS = [
    [3, (1, 4, 6), 2, (1, 2, 2), 1],
    [1, (2, 4, 2), 4],
    [2, (1, 2, 8), 3],
]


def _layout(pad_left: bool = True):
    """(image mask `[B, S]`, valid `[B, S]`, grids per row), rows left-padded to the longest."""
    rows, grids = [], []
    for runs in ROWS:
        flags, row_grids = [], []
        for run in runs:
            if isinstance(run, tuple):
                flags += [True] * (math.prod(run) // MERGE**2)
                row_grids.append(run)
            else:
                flags += [False] * run
        rows.append(flags)
        grids.append(row_grids)
    width = max(map(len, rows))
    images = np.zeros((len(rows), width), bool)
    valid = np.zeros((len(rows), width), bool)
    for b, flags in enumerate(rows):
        at = width - len(flags) if pad_left else 0
        images[b, at:at + len(flags)] = flags
        valid[b, at:at + len(flags)] = True
    return images, valid, grids


def test_positions_equal_get_rope_index():
    """Several images of different grids (a two-frame one among them), left padding: equal, with the deltas."""
    images, valid, grids = _layout()
    ours, deltas = three_axis_positions(images, valid, grids, MERGE)
    host = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=MERGE)), get_vision_position_ids=lambda *a, **k:
        modeling_qwen3_5.Qwen3_5Model.get_vision_position_ids(None, *a, **k))
    grid_thw = torch.tensor([grid for row in grids for grid in row])
    theirs, their_deltas = modeling_qwen3_5.Qwen3_5Model.get_rope_index(
        host, torch.zeros(images.shape, dtype=torch.long), mm_token_type_ids=torch.from_numpy(images.astype(np.int64)),
        image_grid_thw=grid_thw, attention_mask=torch.from_numpy(valid.astype(np.int64)))
    np.testing.assert_array_equal(ours, theirs.permute(1, 2, 0).numpy())
    np.testing.assert_array_equal(deltas, their_deltas[:, 0].numpy())
    assert deltas.min() < 0  # images advance positions by their grid's side, less than their token count


@pytest.mark.parametrize("bad, says", [
    (dict(grids=[[(1, 4, 6), (1, 2, 2)], [(2, 4, 2)], []]), r"row 2 holds more image runs than its 0 image grid"),
    (dict(grids=[[(1, 4, 6), (1, 2, 2), (1, 2, 2)], [(2, 4, 2)], [(1, 2, 8)]]), r"row 0 was given 3 image grid"),
    (dict(grids=[[(1, 4, 6), (1, 2, 2)], [(2, 4, 4)], [(1, 2, 8)]]), r"run of 4 image tokens where its grid"),
    (dict(grids=[[(1, 4, 6), (1, 2, 2)], [(2, 4, 2)], [(1, 3, 8)]]), r"does not divide into 2x2 merged patches"),
])
def test_positions_refuse_grids_the_prompt_disagrees_with(bad, says):
    images, valid, _ = _layout()
    with pytest.raises(ValueError, match=says):
        three_axis_positions(images, valid, bad["grids"], MERGE)


def _rotated(x_BSHD, cos, sin):
    return np.asarray(apply_rotary(jnp.asarray(x_BSHD), cos, sin))


@pytest.mark.parametrize("interleaved", [True, False])
def test_tables_rotate_as_transformers_rotates(interleaved):
    """Qwen 3.5's interleaved layout (its rotary embedding) and Qwen2-VL's chunked one (its
    text rotary embedding) rotate a query alike: the same float32 angles, then each library's
    sin and cos (2 ulps), a product and a sum (2 ulps), of values of size up to 4 (observed: 2.4e-7)."""
    head_dim, theta, section = 16, 10_000.0, (3, 3, 2)
    positions = np.random.default_rng(3).integers(0, 300, (2, 7, 3))
    x = np.random.default_rng(4).normal(size=(2, 7, 2, head_dim)).astype(np.float32)
    cos, sin = rotary_angles(jnp.asarray(positions), head_dim, theta,
                             RopeScaling(mrope_section=section, mrope_interleaved=interleaved))
    ours = _rotated(x, cos, sin)
    thw = torch.from_numpy(positions).permute(2, 0, 1)
    rope = dict(rope_type="default", rope_theta=theta, mrope_section=list(section))
    if interleaved:
        config = transformers.Qwen3_5TextConfig(head_dim=head_dim, rope_parameters=dict(rope, partial_rotary_factor=1.0))
        module, embedding = modeling_qwen3_5, modeling_qwen3_5.Qwen3_5TextRotaryEmbedding
    else:
        config = transformers.Qwen2VLTextConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=rope)
        module, embedding = modeling_qwen2_vl, modeling_qwen2_vl.Qwen2VLRotaryEmbedding
    their_cos, their_sin = embedding(config)(torch.zeros(1), thw)
    theirs = module.apply_rotary_pos_emb(torch.from_numpy(x).transpose(1, 2), torch.zeros(1),
                                         their_cos, their_sin)[0].transpose(1, 2).numpy()
    assert_within(ours, theirs, ulp_bound(2 * LIBRARY_ULPS + 2, 4.0), "rotated")
    # text slots (equal axes) rotate as the one-axis table does
    equal = np.repeat(positions[..., :1], 3, axis=-1)
    cos3, sin3 = rotary_angles(jnp.asarray(equal), head_dim, theta,
                               RopeScaling(mrope_section=section, mrope_interleaved=interleaved))
    cos1, sin1 = rotary_angles(jnp.asarray(positions[..., 0]), head_dim, theta)
    np.testing.assert_array_equal(np.asarray(cos3), np.asarray(cos1))
    np.testing.assert_array_equal(np.asarray(sin3), np.asarray(sin1))


def test_the_chunked_layout_refuses_sections_that_miss_slots():
    with pytest.raises(ValueError, match=r"mrope_section \[3, 3, 3\] covers 9 frequency slots, and the rotary has 8"):
        rotary_angles(jnp.zeros((1, 2, 3), jnp.int32), 16, 1e4, RopeScaling(mrope_section=(3, 3, 3)))


VOCAB = 64


@pytest.fixture(scope="module")
def text_decoder(tmp_path_factory):
    """A tiny transformers Qwen 3.5 text decoder (a linear layer, then a full one whose rotary turns 8 of 16
    features, sections (2, 1, 1)) and Dew's load of it."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                parameter.normal_(0.0, 0.3) if "norm" not in name else parameter.add_(0.3 * torch.randn_like(parameter))
    directory = tmp_path_factory.mktemp("qwen3_5_text")
    model.save_pretrained(directory)
    return model, load_pretrained(directory)


def test_a_decoder_reads_three_axis_positions_and_decodes_from_each_rows_delta(text_decoder):
    """Prompts laid out around images (their slots hold ordinary ids here: the text decoder alone), left
    padded; Dew's logits over the whole sequence, and over a prefill then three cached decode steps given
    no positions, equal transformers' over the whole sequence, whose continuation positions follow each
    row's delta. fp32, the hybrid families' bound (tests/interop/test_qwen3_next.py; observed: 6.5e-5 over
    the whole sequence, 6.1e-5 at a decode step, against 7.7e-4)."""
    model, bundle = text_decoder
    images, valid, grids = _layout()
    extra = 3
    B, P = images.shape
    prompt_positions, deltas = three_axis_positions(images, valid, grids, MERGE)
    lengths = valid.sum(1)
    after = (lengths + deltas)[:, None] + np.arange(extra)
    positions = np.concatenate([prompt_positions, np.repeat(after[:, :, None], 3, axis=2)], axis=1)
    tokens = np.random.default_rng(7).integers(3, VOCAB, (B, P + extra)).astype(np.int32)
    mask = np.concatenate([valid, np.ones((B, extra), bool)], axis=1)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                       position_ids=torch.from_numpy(positions.astype(np.int64)).permute(2, 0, 1)).logits.numpy()
    magnitude = float(np.abs(theirs[mask]).max())
    tolerance = hybrid_bound(model.config, P + extra, magnitude)
    whole = np.asarray(jax.jit(bundle.model.apply)(bundle.variables, tokens, attention_mask=mask,
                                                   rotary_positions=positions))
    assert_within(whole[mask], theirs[mask], tolerance, "logits over the whole sequence")

    apply = jax.jit(lambda variables, ids, valid_BS, cache, rotary: bundle.model.apply(
        variables, ids, attention_mask=valid_BS, cache=cache, rotary_positions=rotary))
    cache = bundle.model.init_cache(B, P + extra)
    prefilled, cache = apply(bundle.variables, tokens[:, :P], valid, cache, prompt_positions)
    np.testing.assert_array_equal(np.asarray(cache.rotary_delta), deltas)
    assert_within(np.asarray(prefilled)[valid], theirs[:, :P][valid], tolerance, "prefill logits")
    for step in range(extra):
        logits, cache = apply(bundle.variables, tokens[:, P + step:P + step + 1], np.ones((B, 1), bool), cache, None)
        assert_within(np.asarray(logits)[:, 0], theirs[:, P + step], tolerance, f"decode step {step}")
