"""The refines rule itself: a special case the report names takes its general cause's match."""

from __future__ import annotations

from assistant.knowledge.refines import taken_over

REFINES = {"syncbn": ("no-group",), "fsdp-save": ("no-group", "timeout")}


def test_a_named_special_case_takes_only_the_general_causes_that_matched():
    named = {"syncbn", "fsdp-save"}.__contains__
    assert taken_over(REFINES, {"no-group"}, named) == {
        "syncbn": ["no-group"],
        "fsdp-save": ["no-group"],
    }
    assert taken_over(REFINES, {"timeout", "other"}, named) == {"fsdp-save": ["timeout"]}


def test_nothing_is_taken_when_the_report_does_not_name_it_or_the_error_is_absent():
    asked: list[str] = []

    def names(cause: str) -> bool:
        asked.append(cause)
        return cause == "fsdp-save"

    assert taken_over(REFINES, {"no-group"}, names) == {"fsdp-save": ["no-group"]}
    assert taken_over(REFINES, set(), names) == {}
    # The words are only searched where a general cause matched (a long log, one pass less).
    assert asked == ["syncbn", "fsdp-save"]
