"""Record files that are damaged, odd or huge: each refusal names the file, the record and the fix, a dictionary
column reads as its strings, and a long document reaches the tokenizer a line-cut piece at a time."""

import gzip
import json
import shutil

import numpy as np
import pytest

from dew.data import HFTokenizer
from dew.data import record_files
from dew.data import tokenize as tokenize_module
from dew.data.tokenize import tokenize_text

from .conftest import make_corpus
from .test_record_files import expected_ids, write_records
from .test_token_files import ids_of

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


def test_a_lone_surrogate_is_refused_naming_file_line_field_and_fix(bpe_dir, tmp_path):
    source = tmp_path / "records.jsonl"
    # json.dumps writes "\ud83d\ude00" for the pair and "\ud800" alone for the lone one
    source.write_text(json.dumps({"text": "fine 😀"}) + "\n\n" + json.dumps({"text": "bad \ud800 here"}) + "\n")
    with pytest.raises(ValueError, match=rf"^{source}, line 3: field 'text' holds a lone surrogate \\ud800 at "
                                         r"character 4, half of a UTF-16 pair without its other half, .* write the "
                                         r"whole pair \(\\ud83d\\ude00 is one character\) or the character itself, or "
                                         "remove the escape"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)
    nested = tmp_path / "chat.jsonl"  # every reader of records refuses it, by its field
    nested.write_text(json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}) + "\n")
    with pytest.raises(ValueError, match=rf"^{nested}, line 1: field 'messages\[0\].content' holds a lone surrogate"):
        list(record_files.records(nested, "chat"))
    source.write_text(json.dumps({"text": "fine 😀"}) + "\n" + json.dumps({"text": r"a backslash \ud800"}) + "\n")
    tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)  # a pair, and an escaped backslash, are text


def test_a_corrupt_parquet_page_names_the_file(bpe_dir, tmp_path):
    source = tmp_path / "records.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " + "words " * 40 for i in range(400)]}), source,
                   compression="snappy", row_group_size=100)
    data = bytearray(source.read_bytes())
    for index in range(len(data) // 3, len(data) // 3 + 200):  # inside a data page, past the file's footer checks
        data[index] ^= 0x5A
    source.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{source} is damaged: reading its rows from row \d+ \(counting from 0\) on "
                                         r"failed \(.+\): copy or download it again"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)


def test_a_damaged_datasets_directory_names_the_file_at_fault(bpe_dir, tmp_path):
    saved = write_records([{"text": make_corpus(3, seed)} for seed in range(50)], tmp_path / "in", "datasets")
    cut = tmp_path / "cut"
    shutil.copytree(saved, cut)
    arrow = sorted(cut.glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{arrow} is cut short or damaged \(.+\): the datasets directory is damaged; "
                                         "save the dataset again with Dataset.save_to_disk, or copy the directory again"):
        tokenize_text(cut, tmp_path / "out", bpe_dir, 0.0, 1)
    info = tmp_path / "info"
    shutil.copytree(saved, info)
    (info / "dataset_info.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{info / 'dataset_info.json'} is not JSON \(.+\): the datasets directory is "
                                         "damaged"):
        tokenize_text(info, tmp_path / "out", bpe_dir, 0.0, 1)


def test_a_dictionary_encoded_string_column_reads_as_its_strings(bpe_dir, tmp_path):
    documents = [make_corpus(2, seed % 3) for seed in range(9)]  # three texts, repeated: pandas' categoricals
    source = tmp_path / "categorical.parquet"
    pq.write_table(pa.table({"text": pa.array(documents).dictionary_encode()}), source)
    assert pa.types.is_dictionary(pq.ParquetFile(source).schema_arrow.field("text").type)
    tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)
    tokenizer = HFTokenizer(bpe_dir)
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), expected_ids(tokenizer, documents))


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz"])
def test_a_record_past_the_limit_is_refused_naming_its_size_and_the_limit(suffix, bpe_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(record_files, "MAX_RECORD_BYTES", 1000)
    lines = json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 5000}) + "\n"
    source = tmp_path / f"records.{suffix}"
    source.write_bytes(gzip.compress(lines.encode()) if suffix.endswith(".gz") else lines.encode())
    with pytest.raises(ValueError, match=rf"^{source}, line 2 is a record of 5,013 bytes, longer than the 1,000 bytes "
                                         "Dew reads of one record .*: split it into several records"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)


def test_a_long_document_reaches_the_tokenizer_in_line_cut_pieces(bpe_dir, tmp_path):
    tokenizer = HFTokenizer(bpe_dir)
    given = []
    encode, encode_batch = tokenizer.encode, tokenizer.encode_batch
    tokenizer.encode = lambda text: given.append(len(text)) or encode(text)
    tokenizer.encode_batch = lambda texts: given.extend(map(len, texts)) or encode_batch(texts)
    documents = ["a short one\n", make_corpus(400, 1), "another short one\n", make_corpus(300, 2)]
    source = write_records([{"text": text} for text in documents], tmp_path / "in", "jsonl")
    tokenize_text(source, tmp_path / "out", tokenizer, 0.0, 1, chunk_bytes=500)
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), expected_ids(HFTokenizer(bpe_dir), documents))
    assert max(given) < 1000 < min(map(len, documents[1::2]))  # a chunk and the rest of a line, never all of one


def test_text_without_a_line_end_past_the_limit_is_refused(bpe_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_module, "MAX_UNCUT_CHARS", 2000)
    lines = [json.dumps({"text": "words " * 200 + "\nand a line\n"}), json.dumps({"text": "words " * 500})]
    source = tmp_path / "records.jsonl"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{source}, line 2 holds 2,\d+ characters, from character 0 on, without a "
                                         r"line end \(a newline followed by a non-space character\), and Dew gives a "
                                         "tokenizer at most 2,000 at once .*: break the text into lines, or into "
                                         "several documents"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1, chunk_bytes=100)
    text = tmp_path / "one-line.txt"
    text.write_text("x" * 3000 + "\nend\n")
    with pytest.raises(ValueError, match=rf"^{text} holds 2,\d+ characters, from character 0 on, without a line end"):
        tokenize_text(text, tmp_path / "out", "byte", 0.0, 1, chunk_bytes=100)
