"""Tiny transformers checkpoints built in the tests, and a Hub that is never reached."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.objectives.lm import LMObjective
from tests.training.test_trainer import SEQ, _stream

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
WORDS = [f"w{i}" for i in range(97)]

# One case per knob that changes the computation; each names its transformers classes and config.
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500.0)),
    "llama-bias-tied-mha": ("LlamaConfig", "LlamaForCausalLM",
                            dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5, head_dim=8)),
    "ministral-mixed-window": ("MinistralConfig", "MinistralForCausalLM",
                               dict(sliding_window=5, head_dim=8, layer_types=["sliding_attention", "full_attention"])),
    "qwen2-bias-window": ("Qwen2Config", "Qwen2ForCausalLM",
                          dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "gemma2-softcap-alternating": ("Gemma2Config", "Gemma2ForCausalLM",
                                   dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=12,
                                        attn_logit_softcapping=20.0, final_logit_softcapping=8.0)),
    "gemma3-local-global": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                            dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "full_attention"],
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                     "rope_theta": 10000.0}})),
    # Rotary scalings, with pretraining lengths short enough that every kind of frequency band shows.
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})),
    "llama-llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(head_dim=16, max_position_embeddings=128,
                               rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                                "rope_theta": 500.0})),
    "qwen3-yarn-rope": ("Qwen3Config", "Qwen3ForCausalLM",
                        dict(head_dim=16, max_position_embeddings=256,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                              "rope_theta": 100.0})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(eos_token_id=3, pad_token_id=1)),
    "olmo3-window": ("Olmo3Config", "Olmo3ForCausalLM", dict(eos_token_id=3, pad_token_id=1, sliding_window=5)),
    "phi3-fused-window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, pad_token_id=0, eos_token_id=2)),
    # SmolLM3's second layer reads no positions and, with the window switch, slides (its default pattern)
    "smollm3-nope-window": ("SmolLM3Config", "SmolLM3ForCausalLM",
                            dict(no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5, rope_theta=500.0,
                                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "granite-multipliers": ("GraniteConfig", "GraniteForCausalLM",
                            dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                 logits_scaling=2.0)),
}


@pytest.fixture(scope="session", autouse=True)
def offline_hub(tmp_path_factory):
    """Every interop test runs with the Hub offline, and an empty Hub cache and Dew cache of its own."""
    import huggingface_hub.constants as constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        patch.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hub-cache")))
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


def sized(model_type: str, **fields) -> dict:
    """A config.json of `model_type` naming `fields` and, at transformers' defaults, the shape fields a
    config must name (`reference_sizes`): the bare config of the family's reference model."""
    from dew.interop.families import FAMILIES
    from dew.interop.hf_decoders import reference_sizes

    return {"model_type": model_type, **reference_sizes(FAMILIES[model_type].fields), **fields}


def assert_logits_match(bundle, model, tokens) -> None:
    """A loaded `bundle`'s float32 logits of `tokens` against transformers' `model`, within the ulps
    `transformers_decoder_ulps` counts for its config and length."""
    import jax.numpy as jnp
    import numpy as np

    from tests.compiled import compiled
    from tests.tolerances import transformers_decoder_ulps, ulp_bound

    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(np.asarray(tokens))).logits.numpy()
    bound = ulp_bound(transformers_decoder_ulps(model.config, tokens.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)


def greedy_continuations(model, bundle, prompt, tokens: int = 16) -> tuple[list[int], list[int]]:
    """(Dew's, transformers') greedy continuations of `prompt`, `tokens` long: the loaded `bundle`
    through its cache, the transformers `model` through `generate`, neither stopping at an EOS."""
    from dew.sampling import Sampling

    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ours = bundle.text_generation(Sampling(temperature=0.0))([prompt], tokens)
    return [int(token) for token in ours.continuations()[0]], theirs


def in_torch_memory(model):
    """`model` with every parameter and buffer copied into torch's own allocations, returned for chaining.
    `from_pretrained` maps safetensors files, so a reloaded tensor starts wherever the file puts it (8-byte
    offsets); torch's AVX2 kernels sum such a tensor in another order than an aligned one, and the logits then
    differ in the last bits (up to 1.9e-6 seen on an AVX2 EPYC) though every weight is equal. A comparison of a
    reload bit for bit is about the weights, so both sides compute from aligned copies."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()
    return model


def torch_model(case: str, seed: int = 0, **overrides):
    """A transformers model of `case` with random weights of order one, so a wrong convention shows."""
    config_class, model_class, options = CASES[case]
    config = getattr(transformers, config_class)(**{**SHAPE, **options, **overrides})
    torch.manual_seed(seed)
    return scatter_weights(getattr(transformers, model_class)(config).eval())


def scatter_weights(model, std: float = 0.3):
    """`model` with its norm scales moved by 0.1 N(0, 1) and every other tensor drawn from N(0, std)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, std)
    return model


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over `w0 ... w96`, with `w2` as EOS."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))


def save_checkpoint(model, directory: Path, tokenizer: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if tokenizer:
        write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint with a tokenizer and a generation config: (directory, torch model)."""
    model = torch_model("llama")
    model.generation_config.eos_token_id = 2
    directory = save_checkpoint(model, tmp_path_factory.mktemp("llama"), tokenizer=True)
    return directory, model


@pytest.fixture(scope="session")
def deep_llama_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint deep enough for Dew to scan its layers (`DecoderConfig.scan_layers` is 8),
    with a tokenizer: (directory, torch model)."""
    model = torch_model("llama", num_hidden_layers=8)
    model.generation_config.eos_token_id = 2
    directory = save_checkpoint(model, tmp_path_factory.mktemp("deep-llama"), tokenizer=True)
    return directory, model


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def check_training_resumes_bit_exactly(bundle, checkpoint_dir) -> None:
    """A loaded model trained two steps, checkpointed, then two more, equals four straight, bit for bit
    (parameters and optimizer state), and its weights moved."""
    objective = LMObjective(bundle.model, SEQ, pretrained=bundle.variables)
    fit = lambda steps, **where: Trainer(objective, optax.adamw(1e-3), key=jax.random.key(2)).fit(
        _stream(2), steps=steps, verbose=False, **where)
    straight = fit(4)
    fit(2, checkpoint_dir=str(checkpoint_dir))
    resumed = fit(4, checkpoint_dir=str(checkpoint_dir))
    for tree in ("params", "opt_state"):
        ours, theirs = _leaves(getattr(resumed, tree)), _leaves(getattr(straight, tree))
        assert ours.keys() == theirs.keys()
        for path in ours:
            np.testing.assert_array_equal(ours[path], theirs[path], err_msg=f"{tree} {path}")
    assert not np.array_equal(_leaves(straight.params)["['params']['norm']['scale']"],
                              np.asarray(bundle.variables["params"]["norm"]["scale"]))
