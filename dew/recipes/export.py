"""`export_run`: a run's weights as a transformers checkpoint, for transformers, vLLM or Ollama, or as one GGUF
file for llama.cpp and Ollama.

The run's model goes out as the plainest transformers family that computes it exactly
(`dew.interop.export.save_pretrained`: Llama for the recipe's default knobs), with the run's
tokenizer and its preview sampling as generation_config.json. A byte-level run gets a tokenizer.json
that maps each byte to its own id, as `ByteTokenizer` does; a tokenizer without a
tokenizer_config.json gets one naming its EOS token, so `AutoTokenizer` loads it as it was trained.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from dew.data.tokenizers import ByteTokenizer, HFTokenizer
from dew.interop import save_pretrained
from dew.interop.families import family_for
from dew.interop.gguf_out import write_gguf
from dew.interop.hub import CONFIG, GENERATION_CONFIG, TOKENIZER_FILES
from dew.inference import BlockGeneration, MaskedGeneration
from dew.interop.safetensors_files import INDEX, SINGLE, read_index
from dew.runs.generation import pipeline, run_of
from dew.runs.run_dir import CHECKPOINTS, RUN_JSON

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_format(out: str | os.PathLike, format: str | None) -> str:
    """The format an export to `out` is written in: `format`, or by default "gguf" for an `out` ending in .gguf
    and "safetensors" (a transformers checkpoint, a directory) for any other; a safetensors export to a .gguf
    `out` is refused, since a directory of that name would read as a GGUF file."""
    gguf_name = os.fspath(out).endswith(".gguf")
    if format is None:
        return "gguf" if gguf_name else "safetensors"
    if format not in ("safetensors", "gguf"):
        raise ValueError(f"format {format!r} is not one dew export writes: use safetensors (a transformers "
                         "checkpoint) or gguf (one file for llama.cpp and Ollama)")
    if format == "safetensors" and gguf_name:
        raise ValueError(f"OUT {out} ends in .gguf, and --format safetensors writes a directory (a transformers "
                         "checkpoint): drop --format to write one GGUF file there, or name a directory")
    return format


def export_run(run: str | os.PathLike, out: str | os.PathLike, *, ema: bool = True, step: int | None = None,
               force: bool = False, format: str | None = None, outtype: str = "f16") -> Path:
    """Write run directory (or checkpoint directory) `run` at `step` (default the newest) as a transformers
    checkpoint in `out`, or with `format="gguf"` as the GGUF file `out` (its matrices in `outtype`: "f32",
    "f16" or "q8_0"; `dew.interop.gguf_out`): the averaged weights when `ema` and the run keeps them, else the
    live ones. `format` None is gguf for an `out` ending in .gguf, else safetensors (`export_format`).

    `out` is a new or empty directory; one that holds anything is refused unless `force`, and then
    the files `replaced_by_export` names are replaced (an earlier export's, atomically) and the others
    kept; a file is refused. A GGUF `out` is a file, refused when it exists unless `force`. A run directory,
    and the checkpoints inside one, are refused whatever `force` says.
    """
    format = export_format(out, format)
    source = run_of(Path(run))[0]
    if source is None:
        raise FileNotFoundError(f"{run} is not a run directory (it holds no run.json, nor is it RUN/checkpoints/STEP): "
                                "dew export writes a trained run; a loaded checkpoint saves with Pretrained.save")
    if format == "gguf":
        _check_gguf_target(source, out, force)
    else:
        _check_target(source, out, force)
    task = pipeline(run, ema=ema, step=step)
    if isinstance(task, MaskedGeneration):
        raise ValueError(f"{run} is a masked-diffusion run (a bidirectional decoder unmasking id "
                         f"{task.process.mask_id}), and dew export writes token-by-token decoders: no transformers "
                         "family computes this model without its own masking recipe; generate from the run with dew "
                         "generate or dew.pipeline")
    if isinstance(task, BlockGeneration):
        raise ValueError(f"{run} is a block-diffusion run (DiffusionGemma), and dew export writes token-by-token "
                         "decoders: save it in Python with dataclasses.replace(bundle, model=objective.model).save("
                         "directory, variables=state.params), or generate from the run with dew generate or "
                         "dew.pipeline")
    with tempfile.TemporaryDirectory(prefix="dew-export-tokenizer-") as staging:
        tokenizer_dir = tokenizer_files(task.tokenizer, Path(staging), task.model.config.max_seq_len)
        if format == "gguf":
            return write_gguf(out, task.model, family_for(task.model.config), task.params, tokenizer_dir, outtype,
                              name=source.name)
        return save_pretrained(task.model, task.params, out, tokenizer_dir=tokenizer_dir, generation=task.sampling,
                               max_new_tokens=task.max_new_tokens)


def replaced_by_export(out: str | os.PathLike) -> list[str]:
    """The entries of `out` an export written there replaces, sorted: the files it writes (config.json,
    generation_config.json, the tokenizer's, the weights) and the weight shards an earlier export's index
    names, which the new export removes."""
    out = Path(out)
    if not out.is_dir():
        return []
    names = {CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES, SINGLE, INDEX}
    try:
        names.update(read_index(out / INDEX).values())
    except (OSError, ValueError):  # no index, or one the save replaces without knowing its shards
        pass
    return sorted(entry.name for entry in out.iterdir() if entry.name in names)


def _check_target(run: Path, out: str | os.PathLike, force: bool) -> None:
    """Refuse an empty `out`, one that is a run directory or inside a run's checkpoints, and, unless
    `force`, a directory that holds anything."""
    if os.fspath(out) == "":
        raise ValueError("OUT is an empty path, which would write the export into the current directory: name a new "
                         "or empty directory")
    out = Path(out)
    if (out / RUN_JSON).is_file() or out.resolve().is_relative_to((run / CHECKPOINTS).resolve()):
        what = "the run directory" if out.resolve() == run.resolve() else (
            "a run directory" if (out / RUN_JSON).is_file() else f"inside {run}'s checkpoints")
        raise ValueError(f"OUT {out} is {what}: an export there would write over the run's own files (its "
                         "tokenizer.json, its checkpoints); choose a directory outside the run, e.g. "
                         f"{run.parent / (run.name + '-hf')}")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT {out} is a file, and a transformers checkpoint is a directory: name a new or empty "
                              "directory, or pass --format gguf to write one GGUF file")
    entries = sorted(entry.name for entry in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        replaced = replaced_by_export(out)
        shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
        effect = (f"it would replace {', '.join(replaced)}" if replaced else "nothing there would be replaced")
        raise FileExistsError(f"OUT {out} is not empty (it holds {shown}): pass --force to write the export there "
                              f"({effect}; the rest stays), or choose a new or empty directory")


def _check_gguf_target(run: Path, out: str | os.PathLike, force: bool) -> None:
    """Refuse an empty `out`, a directory, a file inside the run, and, unless `force`, a file that exists."""
    if os.fspath(out) == "" or Path(out).is_dir():
        what = "a directory" if os.fspath(out) else "an empty path"
        raise ValueError(f"OUT {str(out)!r} is {what}: a GGUF export is one file; name it, e.g. "
                         f"{run.parent / (run.name + '.gguf')}")
    if Path(out).resolve().is_relative_to(run.resolve()):
        raise ValueError(f"OUT {out} is inside the run directory {run}: choose a file outside it, e.g. "
                         f"{run.parent / (run.name + '.gguf')}")
    if Path(out).exists() and not force:
        raise FileExistsError(f"OUT {out} exists: pass --force to replace it (atomically), or choose another file")


def tokenizer_files(tokenizer, staging: Path, max_length: int) -> Path:
    """A directory holding the tokenizer files transformers reads for `tokenizer`: its own directory when
    it has a tokenizer_config.json, else `staging` with its tokenizer.json and a written config."""
    if isinstance(tokenizer, HFTokenizer):
        source = tokenizer.path.parent
        if (source / "tokenizer_config.json").is_file():
            return source
        (staging / "tokenizer.json").write_bytes(tokenizer.path.read_bytes())
        for name in CONFIG_FILES[1:]:
            if (source / name).is_file():
                (staging / name).write_bytes((source / name).read_bytes())
        eos = None if tokenizer.eos_id is None else tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
    elif isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer().save(str(staging / "tokenizer.json"))
        eos = None
    else:
        raise ValueError(f"the run's tokenizer {tokenizer!r} has no transformers form: export needs a byte or a "
                         "Hugging Face tokenizer")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    if eos is not None:
        config["eos_token"] = eos
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return staging


def byte_tokenizer():
    """A `tokenizers.Tokenizer` equal to `ByteTokenizer`: every UTF-8 byte is one token whose id is its value.

    Byte-level BPE with no merges: the byte-level alphabet spells byte b as one character, which the
    vocabulary maps to id b; the decoder joins the bytes back (invalid UTF-8 becomes U+FFFD, as in
    `ByteTokenizer.decode`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    characters = _byte_characters()
    tokenizer = Tokenizer(models.BPE(vocab={characters[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_characters() -> list[str]:
    """The printable character GPT-2's byte-level alphabet spells each byte with (its published table:
    printable Latin-1 bytes stand for themselves, the others take code points from 256 up, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return [characters[b] for b in range(256)]
