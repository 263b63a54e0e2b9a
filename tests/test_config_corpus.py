"""The corpus of real DeepSpeed configs (tests/data/deepspeed_configs) is whole.

These tests check the corpus, not kmp: each file is listed with where it came
from, parses as JSON, and is named after its source. Loading the training
configs with kmp is a separate test.
"""

import json
import os
import re

import pytest

CORPUS = os.path.join(os.path.dirname(__file__), "data", "deepspeed_configs")
# Files of the corpus's own, not taken from a repository.
OWN = {"SOURCES.json", "README.md", "summarize.py"}
PREFIX = {
    "deepspeedai/DeepSpeed": "deepspeed",
    "deepspeedai/DeepSpeedExamples": "dse",
    "huggingface/accelerate": "accelerate",
    "huggingface/transformers": "transformers",
}
FIELDS = {"file", "repo", "path", "commit", "url", "is_training_config"}


def _records():
    with open(os.path.join(CORPUS, "SOURCES.json")) as f:
        return json.load(f)


RECORDS = _records()


def _id(record):
    return record["file"]


def test_at_least_53_files():
    assert len(RECORDS) >= 53


def test_every_file_present_is_listed_and_every_listed_file_once():
    listed = [r["file"] for r in RECORDS]
    assert len(listed) == len(set(listed))
    present = set(os.listdir(CORPUS)) - OWN - {"__pycache__"}
    assert present == set(listed)


def test_no_two_files_have_the_same_bytes():
    contents = {}
    for record in RECORDS:
        with open(os.path.join(CORPUS, record["file"]), "rb") as f:
            data = f.read()
        assert data not in contents, (record["file"], contents.get(data))
        contents[data] = record["file"]


@pytest.mark.parametrize("record", RECORDS, ids=_id)
def test_record(record):
    assert FIELDS <= set(record), FIELDS - set(record)
    assert re.fullmatch("[0-9a-f]{40}", record["commit"]), record["commit"]
    assert record["repo"] in PREFIX
    assert record["file"] == PREFIX[record["repo"]] + "__" + record["path"].replace("/", "__")
    assert record["url"] == (
        f"https://github.com/{record['repo']}/blob/{record['commit']}/{record['path']}"
    )
    assert isinstance(record["is_training_config"], bool)
    # A file kmp is not meant to train from says why.
    assert record["is_training_config"] or record.get("reason")


@pytest.mark.parametrize("record", RECORDS, ids=_id)
def test_file_parses_as_a_json_object(record):
    with open(os.path.join(CORPUS, record["file"]), "rb") as f:
        config = json.loads(f.read())
    assert isinstance(config, dict)
