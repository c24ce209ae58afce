"""Verdicts say only what is true: every verdict states its source, the KB is
the only source of error patterns, the same error text gets the same verdict,
and the reading order keeps the cause the error names.

Errors come from the KB itself (every cause's `symptoms`, cleaned as the
pipeline cleans a question); facts from every recorded fixture.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest

from assistant.clean import clean_log
from assistant.config import contract_ids
from assistant.knowledge.catalog import load_quietly
from assistant.knowledge.patterns import PatternSet
from assistant.probing.recorded import load_runs
from assistant.results import AnswerRef, CauseResult, Finding, Result, RootError, Verdict
from assistant.verdicts import (
    ERROR_WORDS,
    JUDGES,
    VERDICT_MARGIN,
    apply_verdicts,
    judge,
    reading_order,
    shown_answers,
)

VERDICTS = Path(__file__).parents[2] / "assistant" / "verdicts"
FACTS = Path(__file__).parents[1] / "fixtures" / "facts"
FIXTURES = sorted(p.stem for p in FACTS.glob("*.json"))


@pytest.fixture(scope="module")
def kb():
    knowledge = load_quietly()
    assert knowledge is not None, "the built-in KB must load"
    return knowledge


@pytest.fixture(scope="module")
def signatures(kb) -> dict[str, list[str]]:
    return {cause_id: list(cause.signatures) for cause_id, cause in kb.causes.items()}


@pytest.fixture(scope="module")
def errors(kb) -> list[tuple[str, RootError | None]]:
    """(question, root error) for every KB symptom: real error lines and questions."""
    texts = sorted({s for cause in kb.causes.values() for s in cause.symptoms})
    return [(text, clean_log(text).root_error) for text in texts]


def runs_of(name: str) -> dict:
    return {run.name: run for run in load_runs(FACTS / f"{name}.json")}


def from_error(line: str) -> bool:
    return line.startswith(ERROR_WORDS)


# --- the KB is the only source of error patterns -----------------------------------------


def test_no_verdict_module_carries_a_regex_of_its_own():
    for path in sorted(VERDICTS.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert "re.compile" not in source, f"{path.name} compiles a regex of its own"
        assert "_pattern(" not in source, f"{path.name} builds a pattern of its own"
        # No module-level constant holds a regex or a compiled set either.
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                called = ast.unparse(node.value.func)
                assert not called.endswith(("compile", "PatternSet", "from_patterns")), (
                    f"{path.name}: {ast.unparse(node)}"
                )
    import assistant.verdicts as package

    for module in (getattr(package, name) for name in dir(package)):
        for value in vars(module).values() if hasattr(module, "__dict__") else ():
            assert not isinstance(value, (re.Pattern, PatternSet))


@pytest.mark.parametrize(
    "text",
    [
        "ValueError: Default process group has not been initialized, please make sure to call init_process_group.",
        "AssertionError: Default process group is not initialized",
        "RuntimeError: Default process group has not been initialized, please make sure to call init_process_group.",
    ],
)
def test_both_wordings_of_an_uninitialised_process_group_are_confirmed_by_the_error(
    text, signatures
):
    root = clean_log(text).root_error
    assert root is not None
    verdict = judge("process-group-not-initialized", {}, root, [], "en", signatures, text)
    assert verdict.verdict == "confirmed" and verdict.source == "error"
    assert verdict.evidence[0].startswith("the error says a torch.distributed call ran before")


def test_a_special_case_named_in_the_report_takes_the_general_error_as_its_own():
    """kb refines: in a report that names SyncBN, "Default process group is not
    initialized" is SyncBatchNorm's error, as retrieval reads it too; without
    SyncBN named it stays the general cause's."""
    error = "AssertionError: Default process group is not initialized"
    named = f"Inference with MMSyncBN in the config fails:\n{error}"
    general = CauseResult(id="process-group-not-initialized", title="", score=0.6)
    special = CauseResult(id="syncbn-without-process-group", title="", score=0.8)
    root = clean_log(error).root_error
    answer = apply_verdicts(Result(query=named, causes=[general, special], root_error=root), [], [])
    first, second = answer.causes
    assert first.id == "syncbn-without-process-group"
    assert (first.verdict.verdict, first.verdict.source) == ("confirmed", "error")
    assert "SyncBatchNorm" in first.verdict.evidence[0] and error in first.verdict.evidence[0]
    assert second.verdict.verdict == "not_run"
    plain = apply_verdicts(
        Result(query=f"Training fails:\n{error}", causes=[general, special], root_error=root),
        [],
        [],
    )
    verdicts = {c.id: c.verdict.verdict for c in plain.causes}
    assert verdicts == {
        "process-group-not-initialized": "confirmed",
        "syncbn-without-process-group": "not_run",
    }


def test_a_verdict_follows_the_kb_signatures_it_is_given():
    error = RootError("RuntimeError", "Something brand new went wrong")
    own = {"process-group-not-initialized": ["brand new"]}
    assert judge("process-group-not-initialized", {}, error, [], "en", own).verdict == "confirmed"
    assert judge("process-group-not-initialized", {}, error, [], "en", {}).verdict == "not_run"


# --- every verdict states its source -------------------------------------------------------


def check_source(cause: str, verdict: Verdict, runs: dict, error_text: str, findings) -> None:
    where = f"{cause}: {verdict.verdict}/{verdict.source} {verdict.evidence}"
    assert (verdict.verdict == "not_run") == (verdict.source is None), where
    if verdict.source == "error":
        assert error_text, where
        assert any(from_error(line) for line in verdict.evidence), where
    if verdict.source == "probe":
        assert runs, where
        # At least one line about this machine, not only the error's words.
        assert any(not from_error(line) for line in verdict.evidence), where
    if verdict.source == "script":
        assert any(f.cause_id == cause for f in findings), where
    if not error_text:
        assert not any(from_error(line) for line in verdict.evidence), where


@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_judge_states_a_source_consistent_with_its_verdict(fixture, errors, signatures):
    runs = runs_of(fixture)
    for text, root in [("", None)] + errors:
        for cause in JUDGES:
            verdict = judge(cause, runs, root, [], "en", signatures, text)
            error_text = f"{root.type}: {root.message}" if root else text
            check_source(cause, verdict, runs, error_text, [])


def test_without_probes_only_the_error_or_the_script_decides(errors, signatures):
    finding = Finding("hardcoded-device", 3, "model.to('cuda:0')")
    for text, root in [("", None)] + errors:
        for cause in JUDGES:
            verdict = judge(cause, {}, root, [finding], "en", signatures, text)
            error_text = f"{root.type}: {root.message}" if root else text
            check_source(cause, verdict, {}, error_text, [finding])
            assert verdict.source != "probe"
            if not text:
                assert verdict.verdict == (
                    "confirmed" if cause == "hardcoded-device" else "not_run"
                )


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_verdict_never_rules_out_the_cause_its_error_names(fixture, kb, signatures):
    """The KB's own symptoms of a cause: this machine may be unable to judge it,
    but it never says "ruled out" or "not applicable" beside that error."""
    runs = runs_of(fixture)
    for cause_id, cause in kb.causes.items():
        if cause_id not in JUDGES:
            continue
        for text in cause.symptoms:
            root = clean_log(text).root_error
            names = PatternSet.from_patterns(cause.signatures)
            if not names.search(f"{root.type}: {root.message}" if root else text):
                continue  # a question in words, not the error itself
            verdict = judge(cause_id, runs, root, [], "en", signatures, text)
            assert verdict.verdict in ("confirmed", "inconclusive"), (
                f"{fixture} {cause_id} {text!r}: {verdict}"
            )


# --- the same error text, the same verdict ---------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "No backend type associated with device type cpu",
        "RuntimeError: No backend type associated with device type cpu",
        "when I call all_reduce I get No backend type associated with device type cpu, why?",
        "all_reduce 报错 No backend type associated with device type cpu 怎么办",
    ],
)
def test_an_error_line_alone_or_inside_a_sentence_gets_one_verdict(text, signatures):
    root = clean_log(text).root_error
    runs = runs_of("cpu_2ranks")  # this torch has no NCCL: the probe cannot judge it
    verdict = judge("nccl-with-cpu-tensors", runs, root, [], "en", signatures, text)
    assert (verdict.verdict, verdict.source) == ("confirmed", "error")
    assert verdict.evidence[0].startswith("the error is NCCL refusing a CPU tensor")
    assert "No backend type associated with device type cpu" in verdict.evidence[0]


def test_nccl_missing_on_a_cpu_only_torch_is_confirmed_here_not_ruled_out(signatures):
    text = "RuntimeError: Distributed package doesn't have NCCL built in"
    root = clean_log(text).root_error
    verdict = judge("nccl-not-available", runs_of("cpu_2ranks"), root, [], "en", signatures)
    assert (verdict.verdict, verdict.source) == ("confirmed", "probe")
    assert "CPU-only build without NCCL" in verdict.evidence[0]
    assert verdict.evidence[1].startswith("the error says this torch has no NCCL")
    # On a machine whose torch has NCCL, the error still names the cause: it came
    # from another torch build, which the evidence says.
    there = judge("nccl-not-available", runs_of("healthy_8gpu"), root, [], "en", signatures)
    assert (there.verdict, there.source) == ("confirmed", "error")
    assert any("another torch build" in line for line in there.evidence)
    alone = judge("nccl-not-available", runs_of("healthy_8gpu"), None, [], "en", signatures)
    assert (alone.verdict, alone.source) == ("ruled_out", "probe")


def test_a_timeout_alone_confirms_neither_a_slow_rank_nor_a_mismatch(signatures):
    text = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
    root = clean_log(text).root_error
    runs = runs_of("cpu_2ranks")
    timeout = judge("collective-timeout", runs, root, [], "en", signatures)
    mismatch = judge("collective-mismatch", runs, root, [], "en", signatures)
    assert (timeout.verdict, timeout.source) == ("inconclusive", "error")
    assert (mismatch.verdict, mismatch.source) == ("inconclusive", "error")
    assert "never called it" in timeout.evidence[0] and "--script" in mismatch.evidence[0]
    finding = Finding("collective-mismatch", 21, "all_reduce() runs on rank 0 only")
    scripted = judge("collective-mismatch", runs, root, [finding], "en", signatures)
    assert (scripted.verdict, scripted.source) == ("confirmed", "script")


# --- the reading order --------------------------------------------------------------------


def judged(cause_id: str, score: float, value: str, source: str | None = "probe"):
    source = None if value == "not_run" else source
    return CauseResult(
        id=cause_id, title=cause_id, score=score, verdict=Verdict(value, ["x"], [], source)
    )


def test_within_the_margin_the_order_is_confirmed_inconclusive_not_run_not_applicable_ruled_out():
    step = VERDICT_MARGIN / 4
    close = [
        judged("a", 1.00, "ruled_out"),
        judged("b", 1.00 - 0.5 * step, "not_applicable"),
        judged("c", 1.00 - 1.0 * step, "not_run"),
        judged("d", 1.00 - 1.5 * step, "inconclusive"),
        judged("e", 1.00 - 2.0 * step, "confirmed"),
    ]
    assert [c.id for c in reading_order(close)] == ["e", "d", "c", "b", "a"]


def test_beyond_the_margin_a_machine_fact_does_not_push_aside_the_better_cause():
    # "no GPU here", confirmed by a probe, against the cause the error names.
    causes = [
        judged("nccl-not-available", 1.00, "not_run"),
        judged("no-cuda-visible", 0.27, "confirmed"),
        judged("shm-too-small", 1.00 - VERDICT_MARGIN - 0.01, "confirmed"),
    ]
    assert [c.id for c in reading_order(causes)] == [
        "nccl-not-available",
        "shm-too-small",
        "no-cuda-visible",
    ]
    ruled_out = [judged("best", 1.0, "ruled_out"), judged("weak", 0.6, "not_run")]
    assert [c.id for c in reading_order(ruled_out)] == ["best", "weak"]


def test_what_the_failing_job_itself_confirms_leads_whatever_its_score():
    causes = [
        judged("collective-timeout", 1.00, "inconclusive", "error"),
        judged("no-cuda-visible", 0.95, "confirmed", "probe"),  # within one step
        judged("collective-mismatch", 0.10, "confirmed", "script"),
        judged("unused-parameters", 0.05, "confirmed", "error"),
    ]
    assert [c.id for c in reading_order(causes)] == [
        "collective-mismatch",
        "unused-parameters",
        "no-cuda-visible",
        "collective-timeout",
    ]


def test_a_script_finding_the_error_did_not_retrieve_is_read_in_its_place():
    """Unused parameters found in the script beside an NCCL system error: true of
    the script, but the error's words pointed elsewhere, so it does not lead;
    a finding for a cause the words retrieved, or with no root error, does."""
    found = replace(judged("unused-parameters", 0.2, "confirmed", "script"), signals={})
    retrieved = replace(found, signals={"lexical": 3})
    words = [judged("network-interface", 1.0, "inconclusive"), judged("shm", 0.9, "not_run")]
    beside_error = reading_order([*words, found], root_error=True)
    assert [c.id for c in beside_error] == ["network-interface", "shm", "unused-parameters"]
    assert reading_order([*words, retrieved], root_error=True)[0] is retrieved
    assert reading_order([*words, found], root_error=False)[0] is found


def test_without_retrieval_scores_the_verdicts_alone_order_doctor():
    causes = [
        judged("r", 0.0, "ruled_out"),
        judged("n", 0.0, "not_applicable"),
        judged("u", 0.0, "not_run"),
        judged("c", 0.0, "confirmed"),
        judged("i", 0.0, "inconclusive"),
    ]
    assert [c.id for c in reading_order(causes)] == ["c", "i", "u", "n", "r"]


# --- answers under a cause -------------------------------------------------------------------


def answer(stance: str, advice: str = "", question: str = "", text: str = "") -> AnswerRef:
    return AnswerRef(
        text=text or f"{stance} {advice}",
        lang="en",
        thread="t",
        stance=stance,
        advice=advice,
        question=question,
    )


def test_answers_right_first_and_a_wrong_one_only_with_its_question():
    answers = [
        answer("wrong", text="wrong without its question"),
        answer("wrong", question="Why does barrier hang?", text="wrong with its question"),
        answer("unverified", text="unverified"),
        answer("partly_right", text="partly right"),
        answer("right", text="right"),
    ]
    before = copy.deepcopy(answers)
    shown = shown_answers(answers, set(), set())
    assert [a.text for a in shown] == [
        "partly right",
        "right",
        "unverified",
        "wrong with its question",
    ]
    assert answers == before  # copies: the engine's answers are left as they were


def test_the_machine_outcome_goes_beside_the_stance_and_orders_the_answers():
    answers = [
        answer("right", "remove-set-device"),
        answer("wrong", "set-device-before-init"),
        answer("unverified"),
    ]
    shown = shown_answers(answers, {"remove-set-device"}, {"set-device-before-init"})
    assert [(a.stance, a.here) for a in shown] == [
        ("wrong", "confirmed_here"),  # settled here, so shown even without its question
        ("unverified", ""),
        ("right", "refuted_here"),
    ]
    assert (
        shown[0].to_json()["stance"] == "wrong" and shown[0].to_json()["here"] == "confirmed_here"
    )


def test_apply_verdicts_leaves_its_input_as_it_was(signatures):
    text = "RuntimeError: Distributed package doesn't have NCCL built in"
    given = Result(
        query=text,
        root_error=clean_log(text).root_error,
        causes=[
            CauseResult(
                id="nccl-version-mismatch",
                title="t",
                score=0.2,
                answers=[answer("wrong"), answer("right", "remove-set-device")],
            ),
            CauseResult(id="nccl-not-available", title="t", score=1.0),
            CauseResult(id="no-cuda-visible", title="t", score=0.19),
        ],
    )
    before = copy.deepcopy(given)
    runs = list(runs_of("cpu_2ranks").values())
    result = apply_verdicts(given, runs, [], signatures)
    assert given == before
    assert result is not given and result.causes[0] is not given.causes[1]
    assert [(c.id, c.verdict.verdict) for c in result.causes] == [
        ("nccl-not-available", "confirmed"),
        ("no-cuda-visible", "confirmed"),
        ("nccl-version-mismatch", "not_applicable"),
    ]
    assert [a.stance for a in result.causes[2].answers] == ["right"]


def test_every_contract_cause_is_judged_with_a_source_by_doctor(signatures):
    result = apply_verdicts(
        Result(
            query=None, root_error=None, causes=[judged(c, 0.0, "not_run") for c in contract_ids()]
        ),
        list(runs_of("cpu_2ranks").values()),
        [],
        signatures,
    )
    for cause in result.causes:
        assert (cause.verdict.source is None) == (cause.verdict.verdict == "not_run")
        assert cause.to_json()["verdict_source"] == cause.verdict.source
    order = [c.verdict.verdict for c in result.causes]
    ranks = ["confirmed", "inconclusive", "not_run", "not_applicable", "ruled_out"]
    assert order == sorted(order, key=ranks.index)
