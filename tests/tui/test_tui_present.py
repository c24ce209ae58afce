"""The chat's pure presentation rules (no app needed)."""

from __future__ import annotations

import pytest

from assistant.results import AnswerRef, CauseResult, Verdict
from assistant.tui.present import (
    fix_text,
    human_size,
    interface_lang,
    middle_cut,
    query_preview,
    seconds,
    split_answers,
    verdict_counts,
)
from assistant.tui.strings import UI, tr


@pytest.mark.parametrize(
    ("text", "current", "expected"),
    [
        ("我只有一张卡", "en", "zh"),
        ("what if I use gloo?", "zh", "en"),
        ("RuntimeError: Duplicate GPU detected", "zh", "zh"),  # an error line keeps Chinese
        ("line one\nline two\nline three\nline four", "zh", "zh"),  # a log keeps it too
        ("DDP 一直报错找不到设备：RuntimeError: NCCL error", "en", "zh"),
        ("how do I set MASTER_PORT?", "en", "en"),
    ],
)
def test_interface_language_follows_questions_not_pasted_logs(text, current, expected):
    assert interface_lang(text, current) == expected


def answer(answer_id, stance, contradicts=(), thread="t"):
    return AnswerRef(
        text=answer_id,
        lang="zh",
        thread=thread,
        stance=stance,
        answer_id=answer_id,
        contradicts=list(contradicts),
    )


def ids(answers):
    return [a.answer_id for a in answers]


def test_answers_split_around_what_is_known_right():
    answers = [
        answer("a8", "right", contradicts=["a2", "a3"]),
        answer("a6", "partly_right"),
        answer("a2", "unverified", contradicts=["a8"]),
        answer("a3", "partly_right"),  # named by the right answer
        answer("a5", "wrong"),
        answer("a7", "refuted_here"),
    ]
    agreeing, contradicting = split_answers(answers)
    assert ids(agreeing) == ["a8", "a6"]
    assert ids(contradicting) == ["a2", "a3", "a5", "a7"]


def test_without_a_known_right_answer_only_known_wrong_ones_contradict():
    agreeing, contradicting = split_answers(
        [answer("a1", "partly_right", contradicts=["a2"]), answer("a2", "unverified")]
        + [answer("a3", "refuted_here")]
    )
    assert ids(agreeing) == ["a1", "a2"] and ids(contradicting) == ["a3"]


def test_answer_ids_are_compared_within_their_own_thread():
    agreeing, contradicting = split_answers(
        [
            answer("a1", "right", contradicts=["a2"], thread="x"),
            answer("a2", "unverified", thread="y"),
        ]
    )
    assert ids(agreeing) == ["a1", "a2"] and contradicting == []


def test_two_answers_this_machine_confirms_both_agree():
    agreeing, contradicting = split_answers(
        [answer("a8", "confirmed_here", ["a7"]), answer("a7", "confirmed_here", ["a8"])]
    )
    assert ids(agreeing) == ["a8", "a7"] and contradicting == []


def test_middle_cut_keeps_the_telling_end_of_an_error():
    message = (
        "NCCL error in: NCCLUtils.hpp:317 " + "x" * 300 + " Last error: Duplicate GPU detected"
    )
    cut = middle_cut(message, 100)
    assert len(cut) == 100 and cut.endswith("Last error: Duplicate GPU detected")
    assert cut.startswith("NCCL error in:") and " … " in cut
    assert middle_cut("short\n message", 100) == "short message"


def test_query_preview_counts_the_lines_after_the_first():
    assert query_preview("\n\nfirst\n\nsecond\nthird\n") == ("first", 2)
    assert query_preview("one line") == ("one line", 0)
    head, more = query_preview("x" * 500)
    assert len(head) == 200 and more == 0


def test_durations_and_sizes():
    assert seconds(0.006) == "6ms" and seconds(0.04) == "40ms" and seconds(0.1) == "0.1s"
    assert seconds(12.34) == "12.3s" and seconds(125) == "2m05s"
    assert human_size(10_400_000) == "10.4 MB" and human_size(250_000) == "250 KB"


def test_verdict_counts_and_fix_text():
    causes = [
        CauseResult("a", "A", 1, fix="prose", verdict=Verdict("confirmed")),
        CauseResult("b", "B", 1, fix_code=" code\n", verdict=Verdict("ruled_out")),
        CauseResult("c", "C", 1),
    ]
    assert verdict_counts(causes) == {"confirmed": 1, "ruled_out": 1, "other": 1}
    assert fix_text(causes[0]) == "prose" and fix_text(causes[1]) == "code"
    assert fix_text(causes[2], {"fix_code": "from entry"}) == "from entry"
    assert fix_text(causes[2]) == ""


def test_every_interface_string_exists_in_both_languages_with_the_same_fields():
    for key, entry in UI.items():
        assert set(entry) == {"en", "zh"}, key
        fields_en = {part.split("}")[0] for part in entry["en"].split("{")[1:]}
        fields_zh = {part.split("}")[0] for part in entry["zh"].split("{")[1:]}
        assert fields_en == fields_zh, key
    assert tr("turn.done", "zh", confirmed=1, ruled_out=2, other=0).startswith("确认 1 个")
    assert tr("verdict_word.confirmed", "zh") == "已确认"  # shared strings come from i18n
    assert tr("no.such.key") == "no.such.key"
