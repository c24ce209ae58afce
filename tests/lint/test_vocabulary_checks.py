"""assistant/lint/checks/vocabulary.py: a tokenizer of the file whose special ids lie
past the vocabulary size it reports (device-side-assert, blind set hp's 18)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from snippets import lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
FIXTURE = SCRIPTS / "special_id_past_the_vocabulary.py"
CAUSE = "device-side-assert"
TOKENIZER = """
class Tok:
    def __init__(self, chars):
        self.chars = sorted(chars)
        self.pad_id = len(self.chars)
        self.eos_id = len(self.chars) + 1
        GROW

    SIZE

    def encode(self, s):
        return [self.stoi[c] for c in s] + [self.eos_id]
"""


def reported(size: str, grow: str = "pass") -> list[int]:
    body = TOKENIZER.replace("SIZE", size).replace("GROW", grow)
    return [line for line, _ in lint_snippet("", body, {CAUSE})]


def test_the_fixtures_last_id_really_has_no_row_in_an_embedding_of_the_size():
    spec = importlib.util.spec_from_file_location("fixture", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = module.CharTokenizer(set("abc"))
    embedding = torch.nn.Embedding(tok.vocab_size, 4)
    with pytest.raises(IndexError, match="index out of range"):
        embedding(torch.tensor(tok.encode("abc")))


@pytest.mark.parametrize(
    "size",
    [
        "@property\n    def vocab_size(self):\n        return len(self.chars) + 1",
        "def __len__(self):\n        return len(self.chars)",
    ],
    ids=["property", "__len__"],
)
def test_a_size_that_leaves_out_the_last_special_id_is_reported(size):
    lines = TOKENIZER.replace("SIZE", size).splitlines()
    size_line = next(n for n, line in enumerate(lines, 1) if "return len(self.chars)" in line)
    assert reported(size) == [size_line]


@pytest.mark.parametrize(
    ("size", "grow"),
    [
        # every special id counted
        ("@property\n    def vocab_size(self):\n        return len(self.chars) + 2", "pass"),
        # the ids are appended to the list the size counts
        (
            "@property\n    def vocab_size(self):\n        return len(self.chars)",
            "self.chars += ['<pad>', '<eos>']",
        ),
        # a size of another list
        ("@property\n    def vocab_size(self):\n        return len(self.itos)", "pass"),
    ],
    ids=["all counted", "appended", "another list"],
)
def test_a_size_that_counts_every_id_is_quiet(size, grow):
    assert reported(size, grow) == []


def test_a_size_kept_in_a_field_is_read_at_its_assignment():
    body = TOKENIZER.replace("SIZE", "pass").replace(
        "GROW", "self.vocab_size = len(self.chars) + 1"
    )
    lines = body.splitlines()
    size_line = next(n for n, line in enumerate(lines, 1) if "self.vocab_size =" in line)
    assert [line for line, _ in lint_snippet("", body, {CAUSE})] == [size_line]
    counted = body.replace(
        "self.vocab_size = len(self.chars) + 1", "self.vocab_size = len(self.chars) + 2"
    )
    assert [line for line, _ in lint_snippet("", counted, {CAUSE})] == []
