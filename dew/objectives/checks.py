"""Construction checks every objective over a decoder shares: one wording for one mistake."""

from __future__ import annotations


def check_decoder_objective(config, *, seq_len: int, ema_decay: float | None, head_chunks: int | None,
                            rows: str) -> None:
    """Refuse settings no objective over `config` (a DecoderConfig) can train with.

    `rows` names what the objective's rows are in the advice ("windows", "rows"). Refused: attention
    dropout (Dew applies none, so training would not be what the rate asks for), a `seq_len` below 1
    or past the model's `max_seq_len`, an `ema_decay` outside [0, 1], and `head_chunks` below 1 (None
    picks the count from the rows).
    """
    if config.attention_dropout > 0:
        raise NotImplementedError(
            f"the model's attention_dropout is {config.attention_dropout}: Dew does not apply attention dropout, "
            "so training would not be the training that rate asks for; build the model with attention_dropout "
            "0.0 to train without it (generation reads the rate nowhere and needs no change)"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len is {seq_len}; it must be at least 1")
    if seq_len > config.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} is longer than the model's max_seq_len {config.max_seq_len}: "
            f"build the model with max_seq_len >= {seq_len} or use shorter {rows}"
        )
    if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
        raise ValueError(f"ema_decay is {ema_decay}; use a value in [0, 1], or None for no EMA")
    if head_chunks is not None and not (isinstance(head_chunks, int) and head_chunks >= 1):
        raise ValueError(f"head_chunks is {head_chunks!r}; give a count of vocabulary tiles of at least 1, or None "
                         "to pick the fewest whose float32 logits fit 64 MiB each")


def init_or_check(model, key, seq_len: int, variables, fill=None):
    """Fresh variables of `model` from `key` (rows of `seq_len` trace the init), or `variables` (a
    checkpoint's, per layer or stacked) in the model's own form, refused unless their tree and shapes are
    the model's. `fill(key, tokens, variables)`, when given, first completes the variables (with fresh
    weights a checkpoint may lack, e.g. lightning indexers)."""
    import jax
    import jax.numpy as jnp

    tokens = jnp.zeros((1, seq_len), jnp.int32)
    if variables is None:
        return model.init(key, tokens, head=False)
    expected = jax.eval_shape(lambda: model.init(key, tokens, head=False))
    variables = model.stack_variables(variables)  # a checkpoint's per-layer tree, in the model's form
    if fill is not None:
        variables = fill(key, tokens, variables)
    got = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), variables)
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got):
        raise ValueError("the pretrained variables do not have this model's parameter tree")
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(got)):
        if want.shape != have.shape:
            raise ValueError(f"pretrained {jax.tree_util.keystr(path)} has shape {have.shape}; the model expects {want.shape}")
    return variables
