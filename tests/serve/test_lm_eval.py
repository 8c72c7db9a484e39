"""lm-evaluation-harness against `dew serve`: its `local-completions` model, with the server's own
tokenizer endpoints (no local tokenizer copy), scores a local multiple-choice task and a local
generate-until task on the session's tiny checkpoint as its `hf` backend scores them on the same
weights in transformers.

Both sides are float32 on the same weights; they differ in summation order only (XLA against torch),
a few ulps (1.2e-7 relative) of logits of magnitude ~10 per token, through two layers and a
log-sum-exp: each token's log-probability within 1e-4, a continuation of k tokens within k * 1e-4
(observed: 4.8e-6 on a continuation's sum).
Nothing is downloaded: the tasks read JSON Lines files written here, and both runs are offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import NAME

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # two lm-eval processes (imports, the hf model) beside the session's server

TOKEN_BOUND = 1e-4
CONTEXTS = ["the quick brown", "a lazy dog while", "seven wizards quietly", "old songs", "jumps over a",
            "the lazy brown fox jumps"]
CHOICES = [" fox", " dog", " hum", " wizards"]


def _write_tasks(directory: Path) -> None:
    """A multiple-choice task and a generate-until task, each a YAML file beside its JSON Lines data."""
    with open(directory / "choice.jsonl", "w") as out:
        for index, context in enumerate(CONTEXTS):
            out.write(json.dumps({"context": context, "choices": CHOICES, "label": index % len(CHOICES)}) + "\n")
    with open(directory / "until.jsonl", "w") as out:
        for context in CONTEXTS:
            out.write(json.dumps({"context": context, "answer": " fox"}) + "\n")
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{context}}\"\n"
    (directory / "dew_choice.yaml").write_text(
        f"task: dew_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (directory / "dew_until.yaml").write_text(
        f"task: dew_until\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'until.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _lm_eval(directory: Path, out: Path, model: str, model_args: str, *flags: str) -> dict:
    """Run `lm-eval run` on both tasks; returns {task: [(doc_id, responses), ...]} from its samples."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "none"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks",
               "dew_choice", "dew_until", "--include_path", str(directory), "--output_path", str(out),
               "--log_samples", "--seed", "1234", *flags]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert finished.returncode == 0, finished.stderr[-4000:]
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = sorted((row["doc_id"], row["resps"], row["filtered_resps"])
                               for row in map(json.loads, path.read_text().splitlines()))
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return {"samples": samples, "results": results, "log": finished.stderr}


def test_lm_eval_local_completions_against_dew_serve_equals_its_hf_backend(server, tiny_chat, tmp_path):
    directory, _ = tiny_chat
    _write_tasks(tmp_path)
    served = _lm_eval(tmp_path, tmp_path / "served", "local-completions",
                      f"model={NAME},base_url={server.url}/v1/completions,max_length=64,timeout=60,max_retries=1",
                      "--batch_size", "4")
    local = _lm_eval(tmp_path, tmp_path / "hf", "hf", f"pretrained={directory},dtype=float32", "--device", "cpu")
    assert "Using remote tokenizer" in served["log"]  # the server's /tokenize, no local copy
    assert served["results"]["dew_choice"]["acc,none"] == local["results"]["dew_choice"]["acc,none"]
    assert served["results"]["dew_until"]["exact_match,none"] == local["results"]["dew_until"]["exact_match,none"]
    choice, reference = served["samples"]["dew_choice"], local["samples"]["dew_choice"]
    assert len(choice) == len(CONTEXTS)
    for (doc, responses, _), (_, expected, _) in zip(choice, reference):
        for (value, greedy), (expected_value, expected_greedy) in zip((r[0] for r in responses),
                                                                       (r[0] for r in expected)):
            assert abs(float(value) - float(expected_value)) <= 4 * TOKEN_BOUND, doc  # a choice is at most 4 tokens
            assert greedy == expected_greedy, doc
    until, reference = served["samples"]["dew_until"], local["samples"]["dew_until"]
    assert [texts for _, texts, _ in until] == [texts for _, texts, _ in reference]
