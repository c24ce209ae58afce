"""assistant.results: a KB cause's fields are mapped once (CauseDoc.from_kb), and a
ranked CauseResult takes the fields it shares with the document from there."""

from __future__ import annotations

from dataclasses import fields

import pytest

from assistant.config import kb_layers
from assistant.knowledge.kb import load_kb
from assistant.results import DOC_FIELDS, AnswerRef, CauseDoc, CauseResult

ENTRIES = [cause.model_dump() for cause in load_kb(kb_layers()).causes.values()]


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry["id"] for entry in ENTRIES])
def test_a_ranked_cause_holds_its_kb_fields_as_the_kb_gives_them(entry: dict) -> None:
    result = CauseResult.from_kb(entry, 0.5)
    shared = [each.name for each in fields(CauseResult) if each.name in DOC_FIELDS]
    # Every KB field a ranked cause shows (the Chinese ones included) is carried.
    assert set(shared) >= {"id", "title", "title_zh", "summary", "summary_zh", "fix", "fix_zh"}
    assert set(shared) >= {"fix_code", "probes"}
    for name in shared:
        expected = entry[name]
        assert getattr(result, name) == (list(expected) if name == "probes" else expected), name
    assert isinstance(result.probes, list)


def test_the_ranked_cause_and_the_document_agree_on_every_shared_field() -> None:
    entry = next(e for e in ENTRIES if e["id"] == "set-device-order")
    doc = CauseDoc.from_kb(entry)
    answer = AnswerRef("text", "en", "thread-1", "right")
    result = CauseResult.from_doc(doc, 0.25, [answer], {"fts": 2})
    assert result == CauseResult.from_kb(entry, 0.25, [answer], {"fts": 2})
    assert (result.score, result.answers, result.signals) == (0.25, [answer], {"fts": 2})
    assert result.verdict.verdict == "not_run"
    assert result.text("title", "zh") == doc.text("title", "zh") != doc.title


def test_a_result_owns_its_lists() -> None:
    entry = ENTRIES[0]
    answers: list[AnswerRef] = []
    first, second = CauseResult.from_kb(entry, 0.1, answers), CauseResult.from_kb(entry, 0.2)
    first.probes.append("extra")
    first.answers.append(AnswerRef("t", "en", "x", "right"))
    assert second.probes == list(entry["probes"]) and answers == []
