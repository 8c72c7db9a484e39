"""`Served`: a checkpoint ready to answer requests: its generation task, checked chat template, prompt
encoder, text decoder and `Engine`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dew.data.chat_template import ChatTemplate, chat_template
from dew.data.tokenizers import HFTokenizer
from dew.inference import TextGeneration
from dew.runs import pipeline
from dew.interop.processors import Processor, load_reference
from dew.nn.multimodal import MultimodalTransformer
from dew.serve.engine import MAX_LOG_PROBS, PREFILL_CHUNK, TOP_K_LIMIT, Engine
from dew.serve.audio import AudioLimits
from dew.serve.images import ImageLimits
from dew.serve.programs import ProgramCache
from dew.serve.prompts import PromptEncoder

logger = logging.getLogger("dew.serve")

DEFAULT_CAPACITY = 1024
"""Positions per slot when `--capacity` is not given (at most the model's max_seq_len)."""


@dataclasses.dataclass
class Served:
    """The model `name` answers to, its task (model, weights, tokenizer, default sampling), its chat
    template (None: chat completions are refused), the encoder of its prompts, and the engine
    generating for it."""

    name: str
    task: TextGeneration
    chat: ChatTemplate | None
    prompts: PromptEncoder
    engine: Engine
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    processor: Processor | None = None  # a multimodal checkpoint's, which lays out the images of a chat
    images: ImageLimits = ImageLimits()
    audio: AudioLimits = AudioLimits()

    @classmethod
    def load(cls, source: str, *, slots: int = 32, capacity: int | None = None, queue: int = 256,
             prefill_rows: int = 4, prefill_chunk: int = PREFILL_CHUNK, name: str | None = None, chat_template_file: str | None = None,
             live: bool = False, quantize: str | None = None, special_tokens_in_messages: bool = False,
             images: ImageLimits = ImageLimits(), max_log_probs: int = MAX_LOG_PROBS,
             audio: AudioLimits = AudioLimits(), dtype: str | None = None, reuse_prefixes: bool = True) -> "Served":
        """Load `source` (whatever `dew.pipeline` reads), find and check its chat template (before any
        compiling, so a broken one is refused at once), and make an engine (which compiles as it starts). With
        `special_tokens_in_messages`, special-token text in a chat message is the token (see `PromptEncoder`).
        `dtype` ("float32", "bfloat16"; None: the source's own) is `dew.pipeline`'s: "bfloat16" holds the
        weights and the KV cache in bfloat16 and multiplies in bfloat16, with float32 sums."""

        task = pipeline(source, ema=not live, quantize=quantize, dtype=dtype)
        if not isinstance(task, TextGeneration):
            raise ValueError(f"{source} holds a {type(task).__name__} model, and dew serve decodes causal language "
                             "models token by token: generate from it with dew generate, or dew.pipeline in Python")
        if task.tokenizer is None:
            raise ValueError(f"{source} has no tokenizer, and the server reads and writes text: put the model's "
                             "tokenizer.json beside its weights")
        config = task.model.config
        capacity = min(config.max_seq_len, DEFAULT_CAPACITY) if capacity is None else capacity
        if capacity > config.max_seq_len:
            raise ValueError(f"--capacity {capacity} is beyond the model's max_seq_len {config.max_seq_len}: "
                             f"serve at most {config.max_seq_len} positions per request")
        chat = _find_chat_template(source, task, chat_template_file)
        if chat is not None:
            chat.check()
        prompts = PromptEncoder(task.tokenizer, special_in_messages=special_tokens_in_messages)
        engine = Engine(task.model, task.params, slots=slots, capacity=capacity, queue_limit=queue,
                        prefill_rows=prefill_rows, eos_token_ids=task.sampling.eos_token_ids,
                        pad_id=task.sampling.pad_id, prefill_chunk=prefill_chunk,
                        top_k_limit=max(task.sampling.top_k or 0, TOP_K_LIMIT), max_log_probs=max_log_probs,
                        reuse_prefixes=reuse_prefixes)
        engine.program_cache = ProgramCache.of(engine)  # None unless JAX's persistent cache is on
        processor = None
        if isinstance(task.model, MultimodalTransformer):
            processor = Processor.of(load_reference(task.tokenizer.path.parent), task.model.config)
        return cls(name or str(source), task, chat, prompts, engine, processor=processor, images=images, audio=audio)

    def tokenize(self, text: str, special_tokens: bool) -> list[int]:
        """`text`'s ids as a completion prompt's (`special_tokens`: with those the tokenizer adds, a BOS)."""
        tokenizer = self.task.tokenizer
        if special_tokens and isinstance(tokenizer, HFTokenizer):
            return tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids
        return self.prompts.text(text)

    def tokenizer_info(self) -> dict:
        """The special tokens' text (None where there is none) and the chat template, as vLLM's
        /tokenizer_info reports them (what a harness reads to use the server's tokenizer)."""
        special = dict(self.chat.special_tokens) if self.chat is not None else {}
        eos = self.task.sampling.eos_token_ids
        return {"eos_token": self.spell()(eos[0]) if eos else special.get("eos_token"),
                "bos_token": special.get("bos_token"), "pad_token": special.get("pad_token"),
                "chat_template": self.chat.template if self.chat is not None else None,
                "model_max_length": self.engine.capacity}

    def spell(self) -> Callable[[int], str]:
        """One token id's text, special tokens included (a log-probability's token, EOS among them)."""
        tokenizer = self.task.tokenizer
        if isinstance(tokenizer, HFTokenizer):
            return lambda token: tokenizer.tokenizer.decode([int(token)], skip_special_tokens=False)
        return lambda token: tokenizer.decode([int(token)])

    def decode(self) -> Callable[[Sequence[int]], str]:
        """Token ids to text, special tokens left out (an EOS never reaches it)."""
        tokenizer = self.task.tokenizer
        if isinstance(tokenizer, HFTokenizer):
            return lambda ids: tokenizer.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
        return tokenizer.decode


def _find_chat_template(source: str, task: TextGeneration, override: str | None) -> ChatTemplate | None:
    """The template named on the command line, else the tokenizer files', else a GGUF file's metadata."""
    tokenizer = task.tokenizer
    special = {}
    if isinstance(tokenizer, HFTokenizer):
        found = chat_template(tokenizer.path.parent)
        if found is not None and override is None:
            return found
        special = dict(found.special_tokens) if found is not None else {}
    if override is not None:
        path = Path(override)
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start}): "
                             "--chat-template takes a Jinja template file") from None
        nul = text.find("\x00")
        if nul >= 0:
            raise ValueError(f"{path} holds a NUL byte at offset {nul}, so it is not a text file: --chat-template "
                             "takes a Jinja template file")
        return ChatTemplate(text, special, str(path))
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        from dew.interop.gguf_files import GGUFCheckpoint

        with GGUFCheckpoint(path) as gguf:
            template = gguf.metadata.get("tokenizer.chat_template")
            tokens = gguf.field("tokenizer.ggml.tokens") if template else None
            ids = {name: gguf.metadata.get(f"tokenizer.ggml.{key}_token_id")
                   for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                                     ("unk_token", "unknown"))}
        if template:
            special = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
            return ChatTemplate(template, special, f"{path} (tokenizer.chat_template)")
    return None
