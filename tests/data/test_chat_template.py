"""render_chat against transformers' apply_chat_template, and chat_template reading the files transformers
writes."""

from __future__ import annotations

import json

import pytest

from dew.data.chat_template import chat_template, render_chat

transformers = pytest.importorskip("transformers")

# SmolLM2-Instruct's template (as its GGUF file carries it): ChatML with a default system turn.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
          "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 2's shape: BOS and EOS by name, alternation enforced with raise_exception, trimmed blocks.
LLAMA2 = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'].strip() + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'].strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""
# tojson keeps non-ASCII text, namespace() carries state, loop controls and a generation block.
TOOLS = """{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {{ message['role'] }}: {{ message | tojson }}
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}
    {% if ns.count > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ? <b>"},
            {"role": "assistant", "content": "  Tout droit.  "}, {"role": "user", "content": "Merci"}]


def _tokenizer(template: str):
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                                chat_template=template)


@pytest.mark.parametrize("template", [CHATML, TOOLS], ids=["chatml", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(template, add_generation_prompt):
    expected = _tokenizer(template).apply_chat_template(MESSAGES, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
    assert render_chat(template, MESSAGES, add_generation_prompt, bos_token="<s>", eos_token="</s>") == expected


def test_special_tokens_and_raise_exception():
    messages = MESSAGES[1:]
    expected = _tokenizer(LLAMA2).apply_chat_template(messages, tokenize=False)
    assert render_chat(LLAMA2, messages, bos_token="<s>", eos_token="</s>") == expected
    assert expected.startswith("<s>") and "[INST] Où est la gare ? <b> [/INST]" in expected and " Tout droit. </s>" in expected
    with pytest.raises(ValueError, match="the chat template refused the messages: Conversation roles must alternate"):
        render_chat(LLAMA2, MESSAGES[2:], bos_token="<s>", eos_token="</s>")


def test_chat_template_reads_what_transformers_saves(tmp_path):
    _tokenizer(LLAMA2).save_pretrained(tmp_path)
    found = chat_template(tmp_path)
    assert found.template == LLAMA2
    assert found.special_tokens["bos_token"] == "<s>" and found.special_tokens["eos_token"] == "</s>"
    assert found.render(MESSAGES[1:]) == _tokenizer(LLAMA2).apply_chat_template(MESSAGES[1:], tokenize=False)


def test_chat_template_reads_tokenizer_config_forms(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": {"content": "</s>"}, "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]}))
    found = chat_template(tmp_path)
    assert found.template == CHATML and found.special_tokens == {"eos_token": "</s>"}
    config.write_text(json.dumps({"eos_token": "</s>"}))
    assert chat_template(tmp_path) is None
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat("{% for %}", MESSAGES)
