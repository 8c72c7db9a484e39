"""Record files in (JSON Lines, Parquet, datasets directories): `dew tokenize` over their documents, EOS between
them, the refusals of a record without its text, and the chat data read from each form."""

import gzip
import json

import numpy as np
import pytest

from dew.data import HFTokenizer
from dew.data.chat_data import read_conversations
from dew.data.record_files import texts
from dew.data.tokenize import tokenize_text

from .conftest import make_corpus
from .test_token_files import ids_of

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

# Documents of a few lines each; one empty, one with a non-ASCII run.
DOCUMENTS = [make_corpus(lines, seed) for seed, lines in enumerate([6, 1, 9, 0, 4, 12, 3])] + ["東京 café\n"]
FORMATS = ("jsonl", "jsonl.gz", "parquet", "datasets")


def write_records(records: list[dict], directory, form: str):
    """The records as one file (or datasets directory) of `form` in `directory`; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    if form.startswith("jsonl"):
        path = directory / f"records.{form}"
        lines = "".join(json.dumps(record) + "\n" for record in records)
        path.write_bytes(gzip.compress(lines.encode()) if form.endswith(".gz") else lines.encode())
    elif form == "parquet":
        path = directory / "records.parquet"
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)
    else:
        path = directory / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def expected_ids(tokenizer, documents):
    ids = []
    for index, document in enumerate(documents):
        ids += ([tokenizer.eos_id] if index else []) + tokenizer.encode(document)
    return ids


@pytest.mark.parametrize("form", FORMATS)
def test_each_record_is_a_document_with_eos_between(form, bpe_dir, tmp_path):
    tokenizer = HFTokenizer(bpe_dir)
    source = write_records([{"id": i, "body": text} for i, text in enumerate(DOCUMENTS)], tmp_path / "in", form)
    # chunks of ~100 characters: several documents to a chunk, and EOS between chunks as well as within
    meta = tokenize_text(source, tmp_path / "out", tokenizer, 0.1, 1, field="body", chunk_bytes=100)
    assert meta["eos_id"] == tokenizer.eos_id
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), expected_ids(tokenizer, DOCUMENTS))


@pytest.mark.slow  # spawns two processes
def test_worker_processes_keep_the_documents_in_order(bpe_dir, tmp_path):
    tokenizer = HFTokenizer(bpe_dir)
    documents = [make_corpus(5, seed) for seed in range(60)]
    source = write_records([{"text": text} for text in documents], tmp_path / "in", "parquet")
    tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 2, chunk_bytes=300)
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), expected_ids(tokenizer, documents))


def test_a_directory_mixes_text_and_record_files(bpe_dir, tmp_path):
    tokenizer = HFTokenizer(bpe_dir)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(DOCUMENTS[0], encoding="utf-8")
    (tmp_path / "in" / "b.txt").write_text(DOCUMENTS[2], encoding="utf-8")
    write_records([{"text": DOCUMENTS[4]}, {"text": DOCUMENTS[5]}], tmp_path / "in" / "c", "jsonl")
    write_records([{"text": DOCUMENTS[6]}], tmp_path / "in" / "d", "parquet")
    tokenize_text(tmp_path / "in", tmp_path / "out", tokenizer, 0.0, 1)
    # text files join as one text (no --eos-between-files); a record file's documents are EOS-bounded
    eos = [tokenizer.eos_id]
    expected = (tokenizer.encode(DOCUMENTS[0] + DOCUMENTS[2]) + eos + tokenizer.encode(DOCUMENTS[4]) + eos
                + tokenizer.encode(DOCUMENTS[5]) + eos + tokenizer.encode(DOCUMENTS[6]))
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), expected)


_NULL = r"row 1 \(counting from 0\) has no 'text' \(it is null\): drop the records without text, or pass --field"
_KIND = r"row 0 \(counting from 0\): column 'text' holds int64, not strings: pass --field"


@pytest.mark.parametrize("form, records, says", [
    ("jsonl", [{"text": "fine"}, {"body": "x"}], r"line 2 has no field 'text' \(it has 'body'\): pass --field"),
    ("jsonl.gz", [{"text": "fine"}, {"text": 7}], r"line 2: field 'text' holds int 7, not a string: pass --field"),
    # columnar: a record without the field holds a null there, and a column holds one kind of value
    ("parquet", [{"text": "fine"}, {"body": "x"}], _NULL),
    ("datasets", [{"text": "fine"}, {"body": "x"}], _NULL),
    ("parquet", [{"text": 7}], _KIND),
    ("datasets", [{"text": 7}], _KIND),
])
def test_a_record_without_its_text_is_refused_naming_file_record_and_fix(form, records, says, bpe_dir, tmp_path):
    source = write_records(records, tmp_path / "in", form)
    with pytest.raises(ValueError, match=rf"^{source}, {says}"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_column_that_does_not_exist_and_a_dataset_dict_are_refused(bpe_dir, tmp_path):
    source = write_records([{"body": "text"}], tmp_path / "in", "parquet")
    with pytest.raises(ValueError, match=r"row 0 \(counting from 0\) has no field 'text' \(its columns are 'body'\): "
                                         r"pass --field"):
        tokenize_text(source, tmp_path / "out", bpe_dir, 0.0, 1)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                                   "test": datasets.Dataset.from_list([{"text": "b"}])})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"holds a DatasetDict of splits \['train', 'test'\]: give one split's "
                                         rf"directory, e.g. {tmp_path / 'dict' / 'train'}"):
        tokenize_text(tmp_path / "dict", tmp_path / "out", bpe_dir, 0.0, 1)
    tokenize_text(tmp_path / "dict" / "train", tmp_path / "out", bpe_dir, 0.0, 1)


def test_records_need_a_tokenizer_with_eos(tmp_path):
    source = write_records([{"text": "a"}], tmp_path / "in", "jsonl")
    with pytest.raises(ValueError, match=r"documents are joined by the tokenizer's EOS token, which tokenizer byte "
                                         r"has none of"):
        tokenize_text(source, tmp_path / "out", "byte", 0.0, 1)


def test_texts_stream_a_batch_at_a_time(tmp_path):
    source = write_records([{"text": str(i)} for i in range(10)], tmp_path / "in", "parquet")
    # row groups of 3, batches of 4 across them
    batches = list(texts(source, "text", batch=4))
    assert [[text for _, text in batch] for batch in batches] == [["0", "1", "2", "3"], ["4", "5", "6", "7"],
                                                                 ["8", "9"]]
    assert batches[1][2] == (f"{source}, row 6", "6")


@pytest.mark.parametrize("form", ["parquet", "datasets"])
def test_chat_data_reads_each_form(form, tmp_path):
    conversations = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
                     for i in range(3)]
    jsonl = write_records(conversations, tmp_path / "jsonl", "jsonl")
    other = write_records(conversations, tmp_path / form, form)
    assert [messages for _, messages in read_conversations(other)] == [m for _, m in read_conversations(jsonl)]
    assert read_conversations(other)[2][0] == f"{other}, row 2"
