"""assistant.i18n: the one place that chooses English or Chinese, and the honest verdict words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from assistant.i18n import (
    STRINGS,
    cause_title,
    decide_question,
    entry_text,
    pick,
    source_and_evidence,
    stance_label,
    t,
    translate,
    verdict_label,
)
from assistant.results import AnswerRef, CauseResult, Finding, Verdict

PACKAGE = Path(__file__).resolve().parents[2] / "assistant"


def cause(verdict: str = "confirmed", source=None, cause_id: str = "hardcoded-device"):
    return CauseResult(
        cause_id,
        "Device hard-coded",
        0.8,
        title_zh="设备写死",
        verdict=Verdict(verdict, source=source),
    )


def test_pick_and_titles_choose_chinese_only_when_there_is_chinese():
    assert pick("en", "中文", "zh") == "中文" and pick("en", "", "zh") == "en"
    assert pick("en", "中文", "en") == "en"
    assert (
        cause_title(cause(), "zh") == "设备写死"
        and cause_title(cause(), "en") == "Device hard-coded"
    )
    assert entry_text({"why": "because", "why_zh": "因为"}, "why", "zh") == "因为"
    assert entry_text({"why": "because"}, "why", "zh") == "because"


def test_every_shared_string_has_both_languages():
    assert all(set(entry) == {"en", "zh"} for entry in STRINGS.values())


def test_translate_falls_back_to_the_shared_table_then_to_the_key():
    table = {"hello": {"en": "hello {name}", "zh": "你好 {name}"}}
    assert translate(table, "hello", "zh", name="x") == "你好 x"
    assert translate(table, "root_error", "zh") == "根本错误"
    assert translate(table, "no.such.key", "zh") == "no.such.key"


@pytest.mark.parametrize(
    ("source", "findings", "en", "zh"),
    [
        ("probe", [], "confirmed · tested on this machine", "已确认 · 已在本机测试"),
        ("error", [], "confirmed · the error says so", "已确认 · 报错本身表明"),
        (
            "script",
            [Finding("hardcoded-device", 17, "cuda:0")],
            "confirmed · your script, line 17",
            "已确认 · 你的脚本第 17 行",
        ),
        ("script", [], "confirmed · your script", "已确认 · 你的脚本"),
        (None, [], "confirmed", "已确认"),
    ],
)
def test_a_verdict_says_where_it_comes_from(source, findings, en, zh):
    assert verdict_label(cause("confirmed", source), "en", findings) == en
    assert verdict_label(cause("confirmed", source), "zh", findings) == zh


def test_only_a_probe_verdict_claims_this_machine():
    for source in ("error", "script", None):
        for verdict in ("confirmed", "ruled_out", "inconclusive", "not_run"):
            label = verdict_label(cause(verdict, source), "en")
            assert "machine" not in label and "here" not in label


def test_a_stance_keeps_its_question_and_the_outcome_stands_beside_it():
    question = "DDP keeps saying it can't find the device, I have one GPU and two processes, why?"
    answer = AnswerRef("set it after", "en", "t", "wrong", question=question, here="refuted_here")
    label = stance_label(answer, "en")
    assert label.startswith("[wrong] on “DDP keeps saying it can't find the device")
    assert "…” · refuted on this machine" in label
    assert len(label) < len(question) + 40  # the question is shortened
    # Older saved results wrote the outcome over the stance: still read right.
    old = AnswerRef("x", "en", "t", "refuted_here")
    assert stance_label(old, "en") == "refuted on this machine"
    assert stance_label(AnswerRef("x", "en", "t", "right"), "zh") == "[正确]"


def test_the_decide_question_is_one_line_in_the_users_language():
    items = ["the full traceback", "nvidia-smi"]
    assert (
        decide_question(items, "en") == "To tell these apart, paste: the full traceback; nvidia-smi"
    )
    assert decide_question(items, "zh").startswith("为了区分这几个原因，请粘贴：")
    assert decide_question([], "en") == ""


def test_no_other_module_of_the_chat_chooses_a_title_by_language():
    """The choice `title_zh if lang == "zh"` lives in assistant.i18n only (the chat's side)."""
    choice = re.compile(r"_zh\s+if\s+lang\s*==")
    for folder in ("tui", "chat"):
        for path in (PACKAGE / folder).rglob("*.py"):
            assert not choice.search(path.read_text(encoding="utf-8")), path


def test_t_keeps_working_for_the_cli_renderer():
    assert t("evidence", "en") == "Evidence"  # render.py reads the shared words through t
    assert t("score", "zh") == "得分"


def test_evidence_is_led_by_where_it_comes_from():
    probe = cause("confirmed", "probe")
    probe.verdict.evidence = ["rank 0 and rank 1 both on GPU-3f2a"]
    assert source_and_evidence(probe, "en") == (
        "tested on this machine: rank 0 and rank 1 both on GPU-3f2a"
    )
    assert source_and_evidence(probe, "zh").startswith("已在本机测试：rank 0")
    unjudged = cause("not_run")
    assert source_and_evidence(unjudged, "en") == ""
