"""llama.cpp decoding one prompt greedily, timed on request: the peer `benchmarks/generate.py --llama-cpp` runs.

    python benchmarks/llama_cpp_peer.py MODEL.gguf PROMPT_IDS_JSON CONTEXT THREADS

Run with an interpreter that has `llama-cpp-python` (the `bench` extra, or a virtualenv of its own:
it builds llama.cpp from source), as a process of its own, so the benchmark's interpreter need not have
it. Loads the model, decodes 2 tokens to warm up, then for every line `N` on standard input decodes N
new tokens from the prompt and writes the seconds it took on a line of standard output.
"""

import json
import sys
import time

import llama_cpp


def main():
    path, prompt, context, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads, n_batch=512, verbose=False)

    def run(n):
        llm.reset()
        made = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            made += 1
            if made == n:
                break

    run(2)
    print(f"ready llama.cpp {llama_cpp.__version__}", flush=True)
    for line in sys.stdin:
        started = time.perf_counter()
        run(int(line))
        print(time.perf_counter() - started, flush=True)


if __name__ == "__main__":
    main()
