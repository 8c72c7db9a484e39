"""`Unmask`: MDLM's reverse sampler, which turns a span of mask ids into tokens over a fixed number
of model evaluations.

Every response position starts masked at time 1. Evaluation `k` of `steps` runs at time
`t_k = 1 - k / steps`; from `t` to the next time `s` each still-masked position is revealed with
probability `(m(t) - m(s)) / m(t)`, `m` being the schedule's mask probability, and a revealed
position takes a token drawn from the model's distribution there (the mask id's logit at -inf, so it
is never drawn). Revealed tokens and the prompt are never changed again (MDLM's carry-over). The
last evaluation is the clean prediction: every position still masked takes its most likely token.
So `steps` counts model evaluations, the clean prediction included, and all response positions are
refined together under bidirectional attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Unmask:
    """MDLM's ancestral sampler over `steps` model evaluations (the last one the clean prediction)."""

    steps: int = 64

    def __post_init__(self):
        check_steps(self.steps)


def check_steps(steps) -> int:
    """`steps` as an int, refused unless it is a whole count of at least one evaluation."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps is {steps!r}; masked generation needs a whole number of model evaluations, at least 1 "
                         "(the last one is the clean prediction)")
    return steps


def times(steps: int) -> jax.Array:
    """float32 `[steps]`: the time of each evaluation, 1 down to `1 / steps`."""
    return 1.0 - jnp.arange(steps, dtype=jnp.float32) / steps


def inverse_cdf(key: jax.Array, logits_NV: jax.Array) -> jax.Array:
    """One token id per row of float32 logits `[N, V]`, int32 `[N]`, drawn from their softmax.

    It inverts each row's cumulative distribution at one uniform number, where
    `jax.random.categorical`'s Gumbel trick draws one per vocabulary entry: at 64 positions of 4,096
    ids the draw takes a sixth of the time on CPU, where it cost as much as the model's evaluation.
    The first id whose cumulative probability exceeds the uniform point is drawn, so an id of
    probability zero (the mask's, at -inf) never is. float32 uniforms resolve 2**-24 of the mass, as
    float32 Gumbel noise truncates its tail: ids below that probability are under-drawn.
    """
    cdf_NV = jnp.cumsum(jax.nn.softmax(logits_NV, axis=-1), axis=-1)
    total_N1 = cdf_NV[:, -1:]
    # Strictly below the total, so some id's cumulative probability always exceeds it.
    point_N1 = jnp.minimum(jax.random.uniform(key, total_N1.shape) * total_N1, jnp.nextafter(total_N1, 0.0))
    return jnp.sum(cdf_NV <= point_N1, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=32)
def compiled_refinement(model, schedule, mask_id: int, steps: int, prompt_width: int, logits_shift: int = 0):
    """One jitted call `(params, canvas_BS, valid_BS, keys_B) -> response_BN int32`.

    `canvas_BS` holds each row's left-padded prompt in its first `prompt_width` columns and anything in
    the response columns after them (they start masked); `valid_BS` marks real slots (prompt tokens
    and every response slot). Row `b` draws only from `keys_B[b]`, so a row's result does not depend
    on the other rows. With `logits_shift` 1 each response position is predicted from the state
    before it (the last prompt token's, for the first).
    """

    def logits_of(params, canvas_BS, valid_BS):
        output = model.apply(params, canvas_BS, attention_mask=valid_BS, head=False)
        S = canvas_BS.shape[1]
        logits_BNV = output.head.logits(output.hidden[:, prompt_width - logits_shift: S - logits_shift])
        return logits_BNV.at[..., mask_id].set(-jnp.inf)

    def draw(key, logits_NV):
        token_key, reveal_key = jax.random.split(key)
        drawn_N = inverse_cdf(token_key, logits_NV)
        return drawn_N, jax.random.uniform(reveal_key, drawn_N.shape)

    @jax.jit
    def run(params, canvas_BS, valid_BS, keys_B):
        params = model.stack_variables(params)  # once, not at every evaluation
        B, S = canvas_BS.shape
        response_BN = jnp.full((B, S - prompt_width), mask_id, jnp.int32)
        masked_BN = jnp.ones(response_BN.shape, bool)
        masks = schedule.mask_probability(times(steps))

        def evaluate(carry, k):
            response_BN, masked_BN = carry
            logits_BNV = logits_of(params, canvas_BS.at[:, prompt_width:].set(response_BN), valid_BS)
            keys = jax.vmap(lambda key: jax.random.fold_in(key, k))(keys_B)
            drawn_BN, uniform_BN = jax.vmap(draw)(keys, logits_BNV)
            reveal_BN = masked_BN & (uniform_BN < (masks[k] - masks[k + 1]) / masks[k])
            return (jnp.where(reveal_BN, drawn_BN, response_BN), masked_BN & ~reveal_BN), None

        (response_BN, masked_BN), _ = jax.lax.scan(evaluate, (response_BN, masked_BN), jnp.arange(steps - 1))
        logits_BNV = logits_of(params, canvas_BS.at[:, prompt_width:].set(response_BN), valid_BS)
        clean_BN = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)
        return jnp.where(masked_BN, clean_BN, response_BN)

    return run
