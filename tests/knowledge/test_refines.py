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


# Two special cases of one general cause, both named in the report.
SHARED = {"syncbn": ("no-group",), "fsdp-save": ("no-group",)}
WORDS = {"syncbn": ["SyncBN"], "fsdp-save": ["FSDP"]}
REPORT = "SyncBN and FSDP: Default process group has not been initialized"


def test_retrieval_hands_a_shared_general_match_to_every_named_special_case():
    from assistant.knowledge.retrieve import Retriever, any_of

    retriever = Retriever.__new__(Retriever)  # only the refines rule's two tables
    retriever.refines = SHARED
    retriever.named_by = {cid: any_of(words) for cid, words in WORDS.items()}
    scores = retriever.refined({"no-group": 3.0, "other": 1.0}, REPORT)
    assert scores == {"syncbn": 3.0, "fsdp-save": 3.0, "other": 1.0}


def test_the_verdicts_hand_a_shared_general_signature_to_every_named_special_case():
    from assistant.verdicts.signatures import as_refined

    signatures = {"no-group": ["process group has not been"], "syncbn": [], "fsdp-save": []}
    refinements = {cid: (SHARED[cid], tuple(WORDS[cid])) for cid in SHARED}
    refined = as_refined(signatures, refinements, REPORT)
    assert refined == {
        "no-group": [],
        "syncbn": ["process group has not been"],
        "fsdp-save": ["process group has not been"],
    }
