"""What the Gemma text families' tests against transformers share (Gemma 4's and Gemma 3n's decoders): logits of
left-padded rows, each cached step's logits, one SGD step on both sides, and save -> transformers reload."""

from __future__ import annotations

import jax
import numpy as np
import optax
from safetensors.numpy import load_file

from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective
from dew.training import Layout, MeshSpec, Trainer
from tests.interop.conftest import greedy_continuations, torch
from tests.tolerances import assert_within

RATE = 1e-2


def their_logits(model, tokens, **kwargs) -> np.ndarray:
    """transformers' float32 logits of `tokens`."""
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64)), **kwargs).logits.numpy()


def check_left_padded_logits(model, bundle, tokens, bound, what: str) -> None:
    """Dew's logits of the real tokens against transformers' within `bound(their logits, length)`: the rows
    `tokens` with the first 15 tokens whole and the second left-padded by 4, transformers given the mask and
    positions counted from each row's first real token."""
    tokens = np.concatenate([tokens[:, 7:], tokens], axis=1)
    mask = np.ones(tokens.shape, bool)
    mask[1, :4] = False
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = np.asarray(jax.jit(bundle.model.apply)(bundle.variables, tokens, attention_mask=mask))
    theirs = their_logits(model, tokens, attention_mask=torch.from_numpy(mask.astype(np.int64)),
                          position_ids=torch.from_numpy(positions))
    assert_within(ours[mask], theirs[mask], bound(theirs, tokens.shape[1]), what)


def check_cached_continuation(model, bundle, prompt: list[int], bound, what: str) -> None:
    """Dew's cached greedy continuation of `prompt` (16 tokens) equals transformers' `generate`, and the logits of
    each cached step (the prompt in one call, then a token a call) match transformers' over the whole sequence
    within `bound(their logits, length)`."""
    ours, theirs = greedy_continuations(model, bundle, prompt)
    assert ours == theirs, what
    sequence = np.asarray([prompt + theirs], np.int32)
    whole = their_logits(model, sequence)
    assert_within(_cached_step_logits(bundle, sequence, len(prompt)), whole, bound(whole, sequence.shape[1]),
                  f"{what} cached")


def _cached_step_logits(bundle, sequence, prompt: int, capacity: int = 32) -> np.ndarray:
    """Dew's logits of `sequence` `[1, S]`: its first `prompt` tokens in one cached call, then one token a call."""
    apply = jax.jit(bundle.model.apply)
    logits, cache = apply(bundle.variables, sequence[:, :prompt], cache=bundle.model.init_cache(1, capacity))
    steps = [logits]
    for i in range(prompt, sequence.shape[1]):
        logits, cache = apply(bundle.variables, sequence[:, i:i + 1], cache=cache)
        steps.append(logits)
    return np.concatenate(steps, axis=1)


def sgd_step_both(bundle, directory, model_class, batch, *, train_mode: bool = False):
    """(Dew's parameters after one SGD step of `RATE` on `batch`, transformers' `model_class` loaded from `directory`
    and stepped the same way, in eval mode; its step runs in training mode with `train_mode`)."""
    objective = LMObjective(bundle.model, batch.shape[1] - 1, pretrained=bundle.variables, ema_decay=None)
    data = Dataset(train=lambda partition: iter([{"text": batch}]), val=None, records=2, batch=2)
    trainer = Trainer(objective, optax.sgd(RATE), key=jax.random.key(3), mesh=MeshSpec(),
                      layout=Layout(min_shard=2**30))
    state = trainer.fit(data, steps=1, log_every=1)

    stepped = model_class.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    stepped.train(train_mode)
    tokens = torch.from_numpy(batch.astype(np.int64))
    stepped(tokens, labels=tokens).loss.backward()
    with torch.no_grad():
        for parameter in stepped.parameters():
            if parameter.grad is not None:
                parameter -= RATE * parameter.grad
    return state.params, stepped.eval()


def check_save_reloads(bundle, directory, model_class, model, out, tokens) -> None:
    """`bundle` saved to `out` holds the tensors of `directory` bit for bit, and transformers' reload of it gives
    `model`'s logits of `tokens` exactly."""
    saved = bundle.save(out)
    source, written = load_file(directory / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(source)
    for name, tensor in source.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    again = model_class.from_pretrained(saved, attn_implementation="eager").eval()
    np.testing.assert_array_equal(their_logits(again, tokens), their_logits(model, tokens))
