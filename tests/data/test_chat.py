"""Chat data: conversations rendered with a checkpoint's template (a SmolLM2-shaped and a Qwen-2.5-shaped one,
written here), a role per token checked by hand and against transformers' assistant masks, ChatData's rows,
the overlong rule, and bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dew.data import ChatData, Role
from dew.data.chat import encode_chat, template_of
from dew.data.chat_template import ChatTemplate
from dew.data.dataset import Partition
from dew.data.tokenizers import HFTokenizer

transformers = pytest.importorskip("transformers")

# SmolLM2-Instruct's format: a default system turn when the first message is not one, ChatML turns.
SMOL = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen 2.5's shape: the system turn is read from messages[0] outside the loop (so an empty conversation does
# not render), tool answers go inside a user turn, a run of tools shares one.
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen 3's habit: earlier assistant turns lose their reasoning once a later turn follows.
REWRITES = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>assistant\\n' + message.content.split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
WORDS = "hello there how are you fine thanks what is two plus three five the answer weather sunny".split()
TALK = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you"},
    {"role": "user", "content": "what is two plus three"},
    {"role": "assistant", "content": "five"},
]


def _tokenizer_dir(directory: Path, template: str | None) -> Path:
    """A byte-level BPE over WORDS with ChatML's special tokens, saved as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                                chat_template=template)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tokenizer directory per template, named by it."""
    root = tmp_path_factory.mktemp("chat")
    return {name: _tokenizer_dir(root / name, template)
            for name, template in (("smol", SMOL), ("qwen", QWEN), ("rewrites", REWRITES), ("none", None))}


def _runs(tokenizer, ids, roles) -> list[tuple[str, str]]:
    """(role name, decoded text) of each run of tokens with one role."""
    runs, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or roles[end] != roles[start]:
            runs.append((Role(roles[start]).name, tokenizer.decode(ids[start:end])))
            start = end
    return runs


def test_smol_roles_follow_each_message_span(checkpoints):
    tokenizer = HFTokenizer(checkpoints["smol"])
    ids, roles = encode_chat(TALK, tokenizer, template_of(tokenizer))
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoints["smol"])
    assert ids.tolist() == list(theirs.apply_chat_template(TALK, tokenize=True, return_dict=True)["input_ids"])
    # The default system turn has no message of its own: the template writes it with the first one.
    assert _runs(tokenizer, ids, roles) == [
        ("USER", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"),
        ("NONE", "<|im_start|>assistant\n"),
        ("ASSISTANT", "how are you<|im_end|>\n"),
        ("USER", "<|im_start|>user\nwhat is two plus three<|im_end|>\n"),
        ("NONE", "<|im_start|>assistant\n"),
        ("ASSISTANT", "five<|im_end|>\n"),
    ]


def test_qwen_roles_follow_each_message_span_and_match_transformers_assistant_mask(checkpoints):
    tokenizer = HFTokenizer(checkpoints["qwen"])
    talk = [{"role": "system", "content": "be brief"}, *TALK[:2],
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "five"}, *TALK[2:]]
    with pytest.raises(ValueError, match=r"renders message 3 \(tool\) differently once later messages follow"):
        encode_chat(talk, tokenizer, template_of(tokenizer))  # a run of tools shares one turn: no span of its own
    talk = talk[:4] + talk[5:]
    ids, roles = encode_chat(talk, tokenizer, template_of(tokenizer))
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoints["qwen"]).apply_chat_template(
        talk, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(theirs["input_ids"])
    np.testing.assert_array_equal(roles == Role.ASSISTANT, np.asarray(theirs["assistant_masks"], bool))
    assert _runs(tokenizer, ids, roles) == [
        ("SYSTEM", "<|im_start|>system\nbe brief<|im_end|>\n"),
        ("USER", "<|im_start|>user\nhello there<|im_end|>\n"),
        ("NONE", "<|im_start|>assistant\n"),
        ("ASSISTANT", "how are you<|im_end|>\n"),
        ("TOOL", "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"),
        ("USER", "<|im_start|>user\nwhat is two plus three<|im_end|>\n"),
        ("NONE", "<|im_start|>assistant\n"),
        ("ASSISTANT", "five<|im_end|>\n"),
    ]
    # Without a system message the default one goes with the first message (the template cannot render none).
    ids, roles = encode_chat(TALK[:2], tokenizer, template_of(tokenizer))
    assert _runs(tokenizer, ids, roles)[0] == (
        "USER", "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n")


def test_a_token_across_a_span_boundary_counts_with_the_later_span():
    class Words:
        """Ids of whole space-separated words, so "a b" + "c" merges "bc" across the cut."""

        def encode(self, text):
            return [sum(map(ord, word)) for word in text.split(" ")]

    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "test")
    ids, roles = encode_chat([{"role": "user", "content": "a b"}, {"role": "tool", "content": "c d"}], Words(), template)
    assert ids.tolist() == [ord("a"), ord("b") + ord("c"), ord("d")]
    assert roles.tolist() == [Role.USER, Role.TOOL, Role.TOOL]


# -- ChatData ------------------------------------------------------------------------------------------
def _write(path: Path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return str(path)


def test_chat_data_packs_conversations_into_rows_by_hand(checkpoints, tmp_path):
    tokenizer = HFTokenizer(checkpoints["smol"])
    conversations = [TALK[:2], TALK, TALK[2:]]
    encoded = [encode_chat(c, tokenizer, template_of(tokenizer)) for c in conversations]
    lengths = [len(ids) for ids, _ in encoded]
    # First fit in file order: the second does not fit beside the first and opens a row, the third goes
    # back beside the first.
    width = max(lengths[0] + lengths[2], lengths[1])
    assert lengths[0] + lengths[1] > width
    spec = ChatData(_write(tmp_path / "talk.jsonl", conversations), width - 1, tokenizer=str(checkpoints["smol"]))
    data = spec.load(batch=2)
    assert data.records == 2 and data.meta["vocab_size"] == tokenizer.vocab_size
    batch = next(data.train(Partition()))
    order = np.argsort(-batch["text_segment_ids"].max(axis=1))  # the row of two conversations first
    rows = {key: values[order] for key, values in batch.items()}
    expected_text = np.zeros((2, width), np.int32)
    expected_roles = np.zeros((2, width), np.int32)
    two = lengths[0] + lengths[2]
    expected_text[0, :two] = np.concatenate([encoded[0][0], encoded[2][0]])
    expected_roles[0, :two] = np.concatenate([encoded[0][1], encoded[2][1]])
    expected_text[1, :lengths[1]], expected_roles[1, :lengths[1]] = encoded[1]
    np.testing.assert_array_equal(rows["text"], expected_text)
    np.testing.assert_array_equal(rows["text_roles"], expected_roles)
    np.testing.assert_array_equal(rows["text_segment_ids"][0], [1] * lengths[0] + [2] * lengths[2] + [0] * (width - two))
    np.testing.assert_array_equal(rows["text_segment_ids"][1], [1] * lengths[1] + [0] * (width - lengths[1]))
    np.testing.assert_array_equal(rows["text_positions"][0, :two], [*range(lengths[0]), *range(lengths[2])])
    unpacked = ChatData(spec.path, width - 1, tokenizer=spec.tokenizer, pack=False).load(batch=3)
    assert unpacked.records == 3


def test_chat_data_resumes_at_the_same_batch_and_validates_in_order(checkpoints, tmp_path):
    path = _write(tmp_path / "talk.jsonl", [TALK[:2], TALK, TALK[2:], TALK[:3]])
    spec = ChatData(path, 127, tokenizer=str(checkpoints["smol"]), val_path=path, pack=False)
    data = spec.load(batch=2, val_batch=3)
    stream = data.train(Partition())
    next(stream)
    state = stream.get_state()
    expected = next(stream)
    resumed = data.train(Partition())
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["text"], expected["text"])
    validation = list(data.val(Partition()))
    assert len(validation) == 1 and validation[0]["text"].shape == (3, 128)
    with pytest.raises(ValueError, match=r"val_batch 5 \(--trainer.val-batch\) is more than the 4 rows of seq_len "
                                         rf"127 \+ 1 the validation conversations of {path} fill"):
        spec.load(batch=2, val_batch=5)


def test_the_fingerprint_follows_the_rows_not_the_files_spelling(checkpoints, tmp_path):
    conversations = [TALK[:2], TALK, TALK[2:]]
    path = _write(tmp_path / "talk.jsonl", conversations)
    spec = ChatData(path, 127, tokenizer=str(checkpoints["smol"]), val_path=path)
    first = spec.load(batch=1).meta["fingerprint"]
    # The same conversations spelled with other JSON spacing and key order: the same rows.
    (tmp_path / "spaced.jsonl").write_text("".join(
        json.dumps({"messages": [dict(reversed(message.items())) for message in messages]}, indent=1).replace("\n", "")
        + "\n" for messages in conversations))
    spaced = dataclasses.replace(spec, path=str(tmp_path / "spaced.jsonl"))
    assert spaced.load(batch=1).meta["fingerprint"] == first
    changed = [*conversations[:2], [{**TALK[2], "content": TALK[2]["content"] + "!"}, *TALK[3:]]]
    other = dataclasses.replace(spec, path=_write(tmp_path / "changed.jsonl", changed))
    assert other.load(batch=1).meta["fingerprint"] != first
    assert dataclasses.replace(spec, val_path=other.path).load(batch=1).meta["fingerprint"] != first


def test_overlong_conversations_are_refused_or_truncated_as_asked(checkpoints, tmp_path):
    tokenizer = HFTokenizer(checkpoints["smol"])
    ids, roles = encode_chat(TALK, tokenizer, template_of(tokenizer))
    path = _write(tmp_path / "talk.jsonl", [TALK[:2], TALK])
    spec = ChatData(path, 64, tokenizer=str(checkpoints["smol"]), pack=False)
    assert len(encode_chat(TALK[:2], tokenizer, template_of(tokenizer))[0]) <= 65 < len(ids)
    with pytest.raises(ValueError, match=rf"talk.jsonl, line 2: the conversation is {len(ids)} tokens, longer than a "
                                         r"row of seq_len \+ 1 = 65.*overlong='truncate'"):
        spec.load(batch=1)
    rows = ChatData(path, 64, tokenizer=spec.tokenizer, pack=False, overlong="truncate").load(batch=2)
    batch = next(rows.train(Partition()))
    full = batch["text_segment_ids"].min(axis=1) == 1
    np.testing.assert_array_equal(batch["text"][full][0], ids[:65])
    np.testing.assert_array_equal(batch["text_roles"][full][0], roles[:65])


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "narrator", "content": "x"}]},
     r"line 1, message 0: role 'narrator' is not a message role: use one of \['system', 'user', 'assistant', 'tool'\]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "line 1, message 0: content is list"),
    ({"conversation": []}, "line 1: each record is an object with a \"messages\" list"),
    ({"messages": [{"role": "user"}]}, "line 1, message 0: .* is not an object with 'role' and 'content'"),
])
def test_bad_conversations_are_refused_by_line(checkpoints, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message):
        ChatData(str(path), 32, tokenizer=str(checkpoints["smol"])).load(batch=1)


def test_a_checkpoint_without_a_chat_template_is_refused(checkpoints, tmp_path):
    path = _write(tmp_path / "talk.jsonl", [TALK])
    with pytest.raises(ValueError, match=r"has no chat template .*has no chat_template.jinja.*--data.template FILE"):
        ChatData(path, 127, tokenizer=str(checkpoints["none"])).load(batch=1)
    # The template may be given as a file instead.
    template = tmp_path / "smol.jinja"
    template.write_text(SMOL)
    data = ChatData(path, 127, tokenizer=str(checkpoints["none"]), template=str(template)).load(batch=1)
    assert data.meta["template"] == str(template) and data.meta["assistant_tokens"] > 0


def test_a_template_that_rewrites_earlier_turns_is_refused(checkpoints):
    tokenizer = HFTokenizer(checkpoints["rewrites"])
    talk = [TALK[0], {"role": "assistant", "content": "<think>hmm</think>fine"}, *TALK[2:]]
    with pytest.raises(ValueError, match=r"talk: the chat template .* renders message 1 \(assistant\) differently once "
                                         "later messages follow"):
        encode_chat(talk, tokenizer, template_of(tokenizer), "talk")
