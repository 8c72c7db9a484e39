"""Finding and reading tokenizer files: damaged files named, and names resolved the same from anywhere."""

import pathlib

import pytest

from dew.data import HFTokenizer


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": ', b'{"version": "1.0"}', b"\xff\xfe", b""])
def test_a_damaged_tokenizer_json_is_named(tmp_path, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=(
            rf"^{tmp_path / 'tokenizer.json'} is not a valid tokenizer.json \(.+\): the file is damaged.*"
            r"delete it and recreate it \(for GPT-2, `make gpt2-tokenizer`\)")) as error:
        HFTokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_damaged_tokenizer_config_is_named(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((pathlib.Path(bpe_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'tokenizer_config.json'} is not a valid tokenizer_config.json"):
        HFTokenizer(tmp_path)
