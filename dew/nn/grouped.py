"""The experts' gated MLP over rows sorted by expert: a grouped matmul, dropless, no loop over experts.

`expert_mlp(x_MD, sizes_E, ...)` computes `down_e(act(x W_gate_e) * (x W_up_e))` for each row with
the weights of its expert, where the rows come sorted by expert (`sizes_E[e]` consecutive rows for
expert `e`; rows past `sum(sizes_E)` belong to none and give zeros). Operands are in the weights'
dtype, every product accumulates in float32, and the output is float32.

Two kernels, chosen by the platform the program is lowered for (`jax.lax.platform_dependent`):
- accelerators: `jax.lax.ragged_dot`, the grouped matmul XLA lowers natively on TPU;
- CPU: JAX lowers `ragged_dot` there as a dense product over every group (each row multiplied by
  all E experts' weights and masked, `jax/_src/lax/lax.py` `_ragged_dot_general_impl`), so it costs
  `E` times the work and is slower than the dense mixture it replaces. The CPU kernel pads each
  expert's rows to whole tiles of `tile` rows and runs the tiles that hold rows in a `fori_loop`,
  one `[tile, D] x [D, F]` product per tile with its expert's weights (no copy of them), the tile's
  whole MLP at once so its hidden activations stay in cache. Its padding is under one tile per
  expert.
Both share one custom VJP and its residuals (the rows, the gate and up activations), so the backward
pass is the same grouped computation: the weight gradients accumulate per expert in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.mlp import ACTIVATIONS

F32 = jnp.float32
_ROWS = (((1,), (0,)), ((), ()))  # [R, D] x [D, F] -> [R, F]
_ROWS_T = (((1,), (1,)), ((), ()))  # [R, F] x [D, F] -> [R, D]
_OUTER = (((0,), (0,)), ((), ()))  # [R, D] x [R, F] -> [D, F]
_LARGEST_TILE = 128


def tile_rows(rows: int, experts: int) -> int:
    """The CPU kernel's tile: about one tile per expert's share of the rows, a power of two in
    [8, 128] (small tiles waste less padding, large ones run the products faster)."""
    share = max(1, -(-rows // experts))
    return int(min(_LARGEST_TILE, max(8, 1 << (share - 1).bit_length())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def expert_mlp(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation: str = "silu"):
    """float32 `[M, D]`: each sorted row through its expert's gated MLP (see the module docstring)."""
    return _forward(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation)[0]


def _forward(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation):
    """(y float32 `[M, D]`, gate and up activations `[M, F]` in the weights' dtype)."""
    x_MD = x_MD.astype(w_gate_EDF.dtype)
    return lax.platform_dependent(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD,
                                  cpu=functools.partial(_tiled_forward, activation=activation),
                                  default=functools.partial(_ragged_forward, activation=activation))


def _expert_mlp_fwd(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation):
    y_MD, gate_MF, up_MF = _forward(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation)
    return y_MD, (x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, gate_MF, up_MF)


def _expert_mlp_bwd(activation, residuals, dy_MD):
    x_MD, sizes_E, w_gate, w_up, w_down, gate_MF, up_MF = residuals
    dx_MD, dw_gate, dw_up, dw_down = lax.platform_dependent(
        x_MD.astype(w_gate.dtype), sizes_E, w_gate, w_up, w_down, gate_MF, up_MF, dy_MD,
        cpu=functools.partial(_tiled_backward, activation=activation),
        default=functools.partial(_ragged_backward, activation=activation))
    return (dx_MD.astype(x_MD.dtype), None, dw_gate.astype(w_gate.dtype), dw_up.astype(w_up.dtype),
            dw_down.astype(w_down.dtype))


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


def _hidden(gate, up, activation, dtype):
    """`act(gate) * up` in float32, rounded once to the operands' dtype."""
    return (ACTIVATIONS[activation](gate.astype(F32)) * up.astype(F32)).astype(dtype)


def _hidden_vjp(gate, up, d_hidden, activation):
    """(d gate, d up) in float32 for `act(gate) * up`."""
    act, act_vjp = jax.vjp(ACTIVATIONS[activation], gate.astype(F32))
    d_hidden = d_hidden.astype(F32)
    return act_vjp(d_hidden * up.astype(F32))[0], d_hidden * act


# -- accelerators: jax.lax.ragged_dot --------------------------------------------------------------
def _ragged(x, w, sizes):
    return lax.ragged_dot(x, w, sizes, preferred_element_type=F32)


def _ragged_forward(x_MD, sizes_E, w_gate, w_up, w_down, *, activation):
    dtype = w_gate.dtype
    gate = _ragged(x_MD, w_gate, sizes_E).astype(dtype)
    up = _ragged(x_MD, w_up, sizes_E).astype(dtype)
    return _ragged(_hidden(gate, up, activation, dtype), w_down, sizes_E), gate, up


def _ragged_backward(x_MD, sizes_E, w_gate, w_up, w_down, gate_MF, up_MF, dy_MD, *, activation):
    dtype = w_gate.dtype
    hidden = _hidden(gate_MF, up_MF, activation, dtype)
    # The transposes of ragged_dot are ragged products too (grouped along the rows for the input,
    # contracting each group's rows for its weights); vjp spells them without a forward product.
    _, down_vjp = jax.vjp(lambda h, w: _ragged(h, w, sizes_E), hidden, w_down)
    d_hidden, dw_down = down_vjp(dy_MD)
    d_gate, d_up = _hidden_vjp(gate_MF, up_MF, d_hidden, activation)
    _, gate_vjp = jax.vjp(lambda x, w: _ragged(x, w, sizes_E), x_MD, w_gate)
    _, up_vjp = jax.vjp(lambda x, w: _ragged(x, w, sizes_E), x_MD, w_up)
    dx_gate, dw_gate = gate_vjp(d_gate.astype(dtype).astype(F32))
    dx_up, dw_up = up_vjp(d_up.astype(dtype).astype(F32))
    return dx_gate + dx_up, dw_gate, dw_up, dw_down


# -- CPU: tiles of one expert's rows, one product per tile -----------------------------------------
def _tiles(sizes_E, rows: int, tile: int):
    """The tiled layout of `rows` sorted rows: (tiles, each tile's expert `[T]`, how many tiles hold
    rows, each padded row's source row `[T * tile]` (`rows` for padding), each sorted row's padded
    row `[rows]` (`T * tile` for a row of no expert))."""
    experts = sizes_E.shape[0]
    tiles = -(-rows // tile) + experts  # sum over experts of ceil(size / tile) never exceeds this
    padded_E = (sizes_E + tile - 1) // tile * tile
    padded_end_E = jnp.cumsum(padded_E)
    padded_start_E = padded_end_E - padded_E
    start_E = jnp.cumsum(sizes_E) - sizes_E
    expert_T = jnp.minimum(jnp.searchsorted(padded_end_E // tile, jnp.arange(tiles), side="right"), experts - 1)
    used = padded_end_E[-1] // tile
    padded_R = jnp.arange(tiles * tile)
    expert_R = expert_T[padded_R // tile]
    offset_R = padded_R - padded_start_E[expert_R]
    source_R = jnp.where(offset_R < sizes_E[expert_R], start_E[expert_R] + offset_R, rows)
    sorted_M = jnp.arange(rows)
    expert_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes_E), sorted_M, side="right"), experts - 1)
    placed_M = jnp.where(sorted_M < jnp.sum(sizes_E), padded_start_E[expert_M] + sorted_M - start_E[expert_M],
                         tiles * tile)
    return tiles, expert_T.astype(jnp.int32), used, source_R, placed_M


def _to_tiles(x_MX, source_R, tiles, tile):
    """Rows `[M, X]` gathered into tiles `[T, tile, X]`, padding rows zero."""
    padded = jnp.concatenate([x_MX, jnp.zeros((1, x_MX.shape[1]), x_MX.dtype)])
    return padded[source_R].reshape(tiles, tile, x_MX.shape[1])


def _from_tiles(x_TRX, placed_M):
    """Tiles `[T, tile, X]` back to the sorted rows `[M, X]` (zero for a row of no expert)."""
    flat = x_TRX.reshape(-1, x_TRX.shape[-1])
    return jnp.concatenate([flat, jnp.zeros((1, flat.shape[1]), flat.dtype)])[placed_M]


def _tiled_forward(x_MD, sizes_E, w_gate, w_up, w_down, *, activation):
    rows, width = x_MD.shape
    dtype, features = w_gate.dtype, w_gate.shape[2]
    tile = tile_rows(rows, sizes_E.shape[0])
    tiles, expert_T, used, source_R, placed_M = _tiles(sizes_E, rows, tile)
    x_TRD = _to_tiles(x_MD, source_R, tiles, tile)

    def one_tile(t, outputs):
        y, gates, ups = outputs
        x, e = x_TRD[t], expert_T[t]
        gate = lax.dot_general(x, w_gate[e], _ROWS, preferred_element_type=F32).astype(dtype)
        up = lax.dot_general(x, w_up[e], _ROWS, preferred_element_type=F32).astype(dtype)
        out = lax.dot_general(_hidden(gate, up, activation, dtype), w_down[e], _ROWS, preferred_element_type=F32)
        return y.at[t].set(out), gates.at[t].set(gate), ups.at[t].set(up)

    empty = (jnp.zeros((tiles, tile, width), F32), jnp.zeros((tiles, tile, features), dtype),
             jnp.zeros((tiles, tile, features), dtype))
    y_TRD, gate_TRF, up_TRF = lax.fori_loop(0, used, one_tile, empty)
    return _from_tiles(y_TRD, placed_M), _from_tiles(gate_TRF, placed_M), _from_tiles(up_TRF, placed_M)


def _tiled_backward(x_MD, sizes_E, w_gate, w_up, w_down, gate_MF, up_MF, dy_MD, *, activation):
    rows = x_MD.shape[0]
    dtype = w_gate.dtype
    tile = tile_rows(rows, sizes_E.shape[0])
    tiles, expert_T, used, source_R, placed_M = _tiles(sizes_E, rows, tile)
    x_TRD, gate_TRF, up_TRF = (_to_tiles(a, source_R, tiles, tile) for a in (x_MD, gate_MF, up_MF))
    dy_TRD = _to_tiles(dy_MD.astype(dtype), source_R, tiles, tile)

    def one_tile(t, grads):
        dx, dw_gate, dw_up, dw_down = grads
        x, e, dy = x_TRD[t], expert_T[t], dy_TRD[t]
        hidden = _hidden(gate_TRF[t], up_TRF[t], activation, dtype)
        dw_down = dw_down.at[e].add(lax.dot_general(hidden, dy, _OUTER, preferred_element_type=F32))
        d_hidden = lax.dot_general(dy, w_down[e], _ROWS_T, preferred_element_type=F32)
        d_gate, d_up = (d.astype(dtype) for d in _hidden_vjp(gate_TRF[t], up_TRF[t], d_hidden, activation))
        dx = dx.at[t].set(lax.dot_general(d_gate, w_gate[e], _ROWS_T, preferred_element_type=F32)
                          + lax.dot_general(d_up, w_up[e], _ROWS_T, preferred_element_type=F32))
        dw_gate = dw_gate.at[e].add(lax.dot_general(x, d_gate, _OUTER, preferred_element_type=F32))
        dw_up = dw_up.at[e].add(lax.dot_general(x, d_up, _OUTER, preferred_element_type=F32))
        return dx, dw_gate, dw_up, dw_down

    zeros = lambda w: jnp.zeros(w.shape, F32)
    dx_TRD, dw_gate, dw_up, dw_down = lax.fori_loop(
        0, used, one_tile, (jnp.zeros(x_TRD.shape, F32), zeros(w_gate), zeros(w_up), zeros(w_down)))
    return _from_tiles(dx_TRD, placed_M), dw_gate, dw_up, dw_down
