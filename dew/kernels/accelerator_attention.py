"""A whole pass's attention in one kernel on an accelerator, never holding the `[S, S]` scores: Pallas's
splash kernel on a TPU (`jax.experimental.pallas.ops.tpu.splash_attention`), cuDNN's fused attention
through `jax.nn.dot_product_attention` on a GPU. Both have their own backward pass.

`choose(impl, ...)` is the kernels wing's choice for one attention call, a pure function of the
implementation asked for (`IMPLS`: the model's `attention`), the backend and the call's shape; it is
recorded like the CPU kernels' (`dew.kernels.policy.recording`):
- `auto`: splash on a TPU; on a GPU, cuDNN where it applies (bfloat16 or float16, one mask that is
  causal or full with an optional window, no packed documents, no score cap, keys and values of one
  width), XLA elsewhere; on the CPU, Dew's own attention (its CPU kernels, `dew.kernels.softmax`).
- `splash` or `cudnn`: that kernel, refused with a ValueError on a backend that cannot run it.
- `xla`: Dew's own attention in XLA (`dew.nn.attention.attend`) everywhere.
A process that sees several devices keeps XLA's attention under `auto` (a Pallas call is not
partitioned by GSPMD; a per-shard kernel is not built), and refuses `splash` there.

Splash expresses the mask as a static block structure (causal, a window, a full mask) plus segment ids
(documents in a packed row, padding), or, for the masks that depend on the batch (image spans read in
both directions, chunks of positions, a prefill's slots), as a boolean `[S, T]` mask per row (not the
scores), whose fully masked blocks are skipped. Lengths are padded to whole tiles; a padded query reads
only padded keys, so no row is empty.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dew.kernels.policy import note, setting

IMPLS = ("auto", "xla", "splash", "cudnn")
BACKENDS = {"splash": "tpu", "cudnn": "gpu"}  # the backend each accelerator kernel runs on
TILE = 128  # splash's lengths are whole multiples of this
BLOCKS = (512, 256, 128)  # splash's tiles: the largest that divides the padded length
FUSED_BACKWARD = False  # splash's backward as its two kernels (dq, then dk and dv), not the fused one
RESIDUALS = "attention"  # the name splash's output and log-sum-exp carry for a remat policy (dew.nn.stack)
_INTERPRET = contextvars.ContextVar("dew_splash_interpret", default=False)
_IMPL = contextvars.ContextVar("dew_attention_impl", default="auto")


def check(impl: str) -> str:
    """`impl` if it names an attention implementation, else a ValueError naming the choices."""
    if impl not in IMPLS:
        raise ValueError(f"attention={impl!r} is not an attention implementation: use one of {', '.join(IMPLS)}")
    return impl


def refused(impl: str) -> str | None:
    """Why `impl` cannot run in this process (the backend lacks its kernel, or several devices share the
    step), or None where it can."""
    check(impl)
    wanted = BACKENDS.get(impl)
    backend = "tpu" if _INTERPRET.get() else jax.default_backend()
    if wanted is not None and backend != wanted:
        return (f"attention {impl!r} runs on a {wanted.upper()} and this process's backend is {backend}: use 'auto' "
                "(the backend's best) or 'xla'")
    if wanted is not None and jax.device_count() > 1:
        return (f"attention {impl!r} over {jax.device_count()} devices is not built (a Pallas or cuDNN call is not "
                "partitioned by GSPMD): use 'auto' or 'xla'")
    return None


def using(impl: str) -> contextlib.AbstractContextManager[None]:
    """Trace under the attention implementation `impl` (the model's `attention`)."""
    return setting(_IMPL, check(impl))


def requested() -> str:
    """The attention implementation `using` put in force (default auto)."""
    return _IMPL.get()


def interpreting() -> contextlib.AbstractContextManager[None]:
    """Let splash run on the CPU through Pallas's interpreter while tracing inside (tests: it is slow)."""
    return setting(_INTERPRET, True)


def choose(impl: str, dtype, *, q_width: int, v_width: int, softcap: float | None, dynamic: bool,
           segmented: bool) -> str:
    """The kernel of one attention call: "splash", "cudnn" or "xla" (Dew's own), for `impl` (see the
    module), queries of `dtype` and keys `q_width` wide, values `v_width` wide, an optional score cap,
    a mask that depends on the batch (`dynamic`) or not, and rows that may hold several documents or
    padding (`segmented`). Raises where `impl` names a kernel this process cannot run."""
    why = refused(impl)
    if why is not None and impl != "auto":
        raise ValueError(why)
    backend = "tpu" if _INTERPRET.get() else jax.default_backend()
    if impl in ("splash", "cudnn"):
        choice = impl
        if impl == "cudnn" and not _cudnn_applies(dtype, q_width, v_width, softcap, dynamic, segmented):
            raise ValueError(f"attention 'cudnn' takes bfloat16 or float16 queries, keys and values of one width at "
                             f"most 128, a causal or full mask with an optional window, no packed documents and no "
                             f"score cap; this call has {jnp.dtype(dtype).name}, widths {q_width}/{v_width}, softcap "
                             f"{softcap}, a batch-dependent mask {dynamic}, segments {segmented}: use 'auto' or 'xla'")
    elif impl == "auto" and refused("splash") is None and backend == "tpu":
        choice = "splash"
    elif impl == "auto" and refused("cudnn") is None and _cudnn_applies(dtype, q_width, v_width, softcap, dynamic,
                                                                       segmented):
        choice = "cudnn"
    else:
        choice = "xla"
    if choice != "xla" or backend != "cpu":  # the CPU's own attention records its kernels itself
        note(f"attention/{jnp.dtype(dtype).name}", choice)
    return choice


def _cudnn_applies(dtype, q_width, v_width, softcap, dynamic, segmented) -> bool:
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and q_width == v_width
            and q_width <= 128 and q_width % 8 == 0 and softcap is None and not dynamic and not segmented)


@functools.cache
def _splash():
    """Pallas's splash module, imported when a pass first asks for it (its import costs a CPU process's start
    half a second, and only a TPU runs it)."""
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def _tiles(length: int) -> int:
    return -(-length // TILE) * TILE


def block_sizes(q_length: int, kv_length: int):
    """Splash's tiles for padded lengths: the largest of `BLOCKS` dividing each, forward and backward."""
    splash = _splash()
    bq = next(b for b in BLOCKS if q_length % b == 0)
    bkv = next(b for b in BLOCKS if kv_length % b == 0)
    dq = {} if FUSED_BACKWARD else dict(block_q_dq=bq, block_kv_dq=bkv)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bkv, use_fused_bwd_kernel=FUSED_BACKWARD, **dq)


def _static_kernel(kind: str, length: int, window: int | None, softcap: float | None, interpret: bool):
    """A splash kernel for one static mask over `length` padded slots: "causal", "full", each with an
    optional window (a key at most `window - 1` slots behind its query). Made at each trace: its mask's
    blocks are arrays of that trace (splash keeps the host-side analysis of a mask it has seen)."""
    splash = _splash()
    shape = (length, length)
    if window is not None:
        mask = splash.LocalMask(shape, (window - 1, 0 if kind == "causal" else None), offset=0)
    elif kind == "causal":
        mask = splash.CausalMask(shape)
    else:
        mask = splash.FullMask(shape)
    return splash.make_splash_mha(splash.MultiHeadMask([mask]), head_shards=1, q_seq_shards=1,
                                  block_sizes=block_sizes(length, length), attn_logits_soft_cap=softcap,
                                  residual_checkpoint_name=RESIDUALS, interpret=interpret)


def _pad(x, axis: int, length: int, value=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def splash_attention(q_BSHD, k_BTKD, v_BTKV, *, scale: float, causal: bool = True, window: int | None = None,
                     softcap: float | None = None, segments_BS=None, mask_BST=None,
                     heads_major: bool = False) -> jax.Array:
    """Attention of queries `[B, S, H, D]` (with `heads_major`, `[B, H, S, D]`, the kernel's own layout) over keys
    `[B, T, K, D]` and values `[B, T, K, V]` (`H` a multiple of `K`) in splash: `[B, S, H, V]` in the queries'
    dtype. Scores are `scale * q . k` (the queries are scaled first), capped to `softcap * tanh(score /
    softcap)` with `softcap`.

    The mask is either static, over a pass whose query `i` is key `i` (`S == T`): causal or full, with an
    optional `window`, and, with `segments_BS` `[B, S]`, only keys of the query's own segment; or given
    whole as the boolean `mask_BST` (a mask that depends on the batch), which must leave no real query
    without a key."""
    q_BHSD = q_BSHD if heads_major else q_BSHD.transpose(0, 2, 1, 3)
    B, H, S, D = q_BHSD.shape
    T = k_BTKD.shape[1]
    interpret = _INTERPRET.get()
    q_BHSD = q_BHSD * jnp.asarray(scale, q_BSHD.dtype)
    k_BKTD, v_BKTV = k_BTKD.transpose(0, 2, 1, 3).astype(q_BSHD.dtype), v_BTKV.transpose(0, 2, 1, 3).astype(q_BSHD.dtype)
    P, Q = _tiles(S), _tiles(T)
    q_BHPD, k_BKQD, v_BKQV = _pad(q_BHSD, 2, P), _pad(k_BKTD, 2, Q), _pad(v_BKTV, 2, Q)
    splash = _splash()
    if mask_BST is not None:
        # a padded query reads the padded key of its own index (P <= Q: padding keys are its diagonal)
        padding_PQ = jnp.asarray(np.arange(P)[:, None] == np.arange(Q)[None, :]) & jnp.asarray(
            (np.arange(P) >= S)[:, None])
        mask_BPQ = _pad(_pad(mask_BST.astype(jnp.bool_), 1, P), 2, Q) | padding_PQ
        sizes = block_sizes(P, Q)

        def one_row(q_HPD, k_KQD, v_KQV, mask_PQ):
            kernel = splash.make_splash_mha(mask_PQ[None], head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                            attn_logits_soft_cap=softcap, residual_checkpoint_name=RESIDUALS,
                                            interpret=interpret)
            # splash turns its mask's flag into an array with the rest; inside a compiled call that array is
            # traced, and the flag must stay a Python bool
            for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
                info = getattr(kernel, name)
                if info is not None:
                    setattr(kernel, name, info._replace(is_dynamic_mask=True))
            return kernel(q_HPD, k_KQD, v_KQV)

        out_BHPV = jax.vmap(one_row)(q_BHPD, k_BKQD, v_BKQV, mask_BPQ)
    else:
        if S != T:
            raise ValueError(f"splash_attention: a static mask reads key i for query i, and the queries are {S} "
                             f"slots, the keys {T}: give mask_BST")
        kernel = _static_kernel("causal" if causal else "full", P, window, softcap, interpret)
        if segments_BS is None and P == S:
            out_BHPV = jax.vmap(kernel)(q_BHPD, k_BKQD, v_BKQV)
        else:
            real_BS = jnp.ones((B, S), jnp.int32) if segments_BS is None else segments_BS.astype(jnp.int32)
            ids_BP = _pad(real_BS, 1, P, value=-1)  # padded slots: a segment no real query has
            out_BHPV = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(ids, ids)))(
                q_BHPD, k_BKQD, v_BKQV, ids_BP)
    return out_BHPV[:, :, :S].transpose(0, 2, 1, 3).astype(q_BSHD.dtype)


def cudnn_attention(q_BSHD, k_BTKD, v_BTKD, *, scale: float, causal: bool = True, window: int | None = None,
                    implementation: str | None = "cudnn") -> jax.Array:
    """Attention of queries `[B, S, H, D]` over keys and values `[B, S, K, D]` in cuDNN's fused kernel
    (`jax.nn.dot_product_attention`; `implementation=None` lets jax pick, as the CPU tests do): causal or
    full, a causal pass optionally windowed to keys at most `window - 1` slots behind."""
    local = None if window is None or not causal else (window - 1, 0)
    out = jax.nn.dot_product_attention(q_BSHD, k_BTKD.astype(q_BSHD.dtype), v_BTKD.astype(q_BSHD.dtype), scale=scale,
                                       is_causal=causal, local_window_size=local, implementation=implementation)
    return out.astype(q_BSHD.dtype)


__all__ = ["BACKENDS", "IMPLS", "check", "choose", "cudnn_attention", "interpreting", "refused", "requested",
           "splash_attention", "using"]
