"""The terminal's words: render.py and explain.py keep their own tables, looked up through
i18n.translate (falling back to the shared STRINGS), and importing them changes nothing shared."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from assistant.cli import main
from assistant.cli.explain import EXPLAIN_WORDS
from assistant.cli.render import CLI_WORDS, answer_lines
from assistant.i18n import STRINGS
from assistant.results import AnswerRef

PACKAGE = Path(__file__).resolve().parents[2] / "assistant"
OWN_TABLES = {"render": CLI_WORDS, "explain": EXPLAIN_WORDS}


def test_importing_the_terminal_modules_leaves_the_shared_table_as_it_was():
    code = (
        "import copy, assistant.i18n as i18n\n"
        "before = copy.deepcopy(i18n.STRINGS)\n"
        "import assistant.cli, assistant.cli.render, assistant.cli.explain\n"
        "print(before == i18n.STRINGS)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "True", done.stderr


def test_no_module_writes_into_the_shared_table():
    writes = re.compile(r"\bSTRINGS\s*(\.\s*(update|setdefault|pop)\b|\[[^\]]*\]\s*=)")
    offenders = [
        path.relative_to(PACKAGE)
        for path in PACKAGE.rglob("*.py")
        if writes.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


@pytest.mark.parametrize("module", sorted(OWN_TABLES))
def test_each_own_word_has_both_languages_and_shadows_no_shared_one(module):
    table = OWN_TABLES[module]
    assert table and all(set(entry) == {"en", "zh"} for entry in table.values())
    assert not set(table) & set(STRINGS), "a shared word redefined here would differ by front end"


@pytest.mark.parametrize(
    ("lang", "own", "shared"),
    [
        ("en", ["The error, as it appears", "Probes that decide it here"], ["Why it happens"]),
        ("zh", ["报错原文（匹配规则）", "可在本机判断的探针"], ["原因", "修复的风险"]),
    ],
)
def test_explain_names_its_sections_in_the_chosen_language(lang, own, shared):
    result = CliRunner().invoke(main, ["explain", "set-device-order", "--lang", lang])
    assert result.exit_code == 0, result.output
    for heading in own + shared:
        assert f"\n{heading}\n" in result.output, heading


@pytest.mark.parametrize(("lang", "said_to"), [("en", "said to: "), ("zh", "针对的问题: ")])
def test_an_answer_names_the_question_it_was_given_to_in_the_language(lang, said_to):
    answer = AnswerRef("Call set_device first.", "en", "t1", "wrong", question="Why a hang?")
    console = Console(width=100, record=True)
    for line in answer_lines(answer, lang):
        console.print(line)
    text = console.export_text()
    assert f"{said_to}Why a hang?" in text
    assert ("[wrong]" if lang == "en" else "[错误]") in text


@pytest.mark.parametrize(
    ("lang", "headers", "statuses"),
    [
        ("en", ["probe", "status", "time", "detail"], ["ok", "timeout", "not applicable"]),
        ("zh", ["探针", "状态", "耗时", "详情"], ["完成", "超时", "不适用"]),
    ],
)
def test_the_probe_table_speaks_the_questions_language(lang, headers, statuses):
    from typing import get_args

    from assistant.cli.render import render_result
    from assistant.results import CauseResult, ProbeRun, ProbeStatus, Result

    for status in get_args(ProbeStatus):  # every status has words in both languages
        assert set(CLI_WORDS[f"probe.{status}"]) == {"en", "zh"}
    probes = [
        ProbeRun("cuda_visibility", "ok", 0.02),
        ProbeRun("port_bind", "timeout", 3.0),
        ProbeRun("nccl_init", "not_applicable", 0.0),
    ]
    result = Result(
        query="q", root_error=None, causes=[CauseResult("x", "X", 0.5)], probes=probes, lang=lang
    )
    console = Console(record=True, width=120)
    render_result(result, console)
    text = console.export_text()
    for word in headers + statuses:
        assert word in text


def test_fix_code_is_highlighted_where_colours_show_and_plain_where_they_do_not():
    from assistant.cli.render import render_result
    from assistant.results import CauseResult, Result

    code = 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))'
    cause = CauseResult(id="set-device-order", title="t", score=0.9, fix="f", fix_code=code)
    result = Result(query="q", root_error=None, causes=[cause])
    outputs = {}
    for colour in ("truecolor", None):
        out = io.StringIO()
        console = Console(file=out, width=100, color_system=colour, force_terminal=bool(colour))
        render_result(result, console)
        outputs[colour] = out.getvalue()
    assert code in outputs[None] and "\x1b[" not in outputs[None]  # piped: the code, unlexed
    # In a terminal the same code is split into highlighted tokens.
    assert "\x1b[" in outputs["truecolor"] and code not in outputs["truecolor"]


def test_on_an_80_column_terminal_ids_and_positions_are_whole_and_the_verdict_wraps():
    from assistant.cli.render import render_result
    from assistant.results import CauseResult, Result, Verdict

    long_ids = ["process-group-not-initialized", "syncbn-without-process-group"]
    causes = [
        CauseResult(
            id=cid, title="t", score=0.5, verdict=Verdict("inconclusive", ["x"], source="probe")
        )
        for cid in long_ids
    ]
    out = io.StringIO()
    render_result(Result(query="q", root_error=None, causes=causes), Console(file=out, width=80))
    rows = [line for line in out.getvalue().splitlines() if "│" in line and "┃" not in line]
    assert any(line.lstrip().startswith("1 │ process-group-not-initialized ") for line in rows)
    assert any(line.lstrip().startswith("2 │ syncbn-without-process-group ") for line in rows)
    assert "…" not in out.getvalue().split("╭")[0]  # nothing in the table is cut
