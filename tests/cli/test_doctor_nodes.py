"""`assistant doctor --nnodes`: the side-by-side table of the nodes speaks the output's
language, like the rest of the machine check (facts recorded from two-node runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from assistant.cli.render import render_machine_check
from assistant.probing.recorded import load_runs
from assistant.results import Result
from assistant.verdicts.nodes import nodes_report

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "nodes"
LABELS = {
    "en": [
        "host",
        "addresses",
        "host name ->",
        "torch",
        "CUDA",
        "NCCL",
        "driver",
        "GPUs",
        "*_SOCKET_IFNAME",
        "nnodes x nproc",
        "master",
        "gloo all_reduce",
        "NCCL all_reduce",
        "problems",
    ],
    "zh": [
        "主机",
        "地址",
        "主机名解析为",
        "torch",
        "CUDA",
        "NCCL",
        "驱动",
        "GPU",
        "*_SOCKET_IFNAME",
        "节点数 x 每节点进程数",
        "主节点",
        "gloo all_reduce",
        "NCCL all_reduce",
        "问题",
    ],
}
NODE = {"en": "node", "zh": "节点"}
NEVER_JOINED = {"en": "never joined", "zh": "未加入"}
COULD_NOT_JOIN = {"en": "could not join", "zh": "无法加入"}
ENGLISH_ONLY = ("host", "addresses", "driver", "problems", "nodes", "never joined")


def nodes_text(report: list[dict], lang: str) -> str:
    result = Result(query=None, root_error=None, causes=[], lang=lang, nodes=report)
    console = Console(width=160, record=True)
    render_machine_check(result, console)
    return console.export_text()


def table_rows(text: str) -> list[list[str]]:
    """The nodes table's rows below its header rule, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("━")) + 1
    start = next(i for i, line in enumerate(lines[start:], start) if "━" in line) + 1
    return [[cell.strip() for cell in line.split("│")] for line in lines[start:] if "│" in line]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_nodes_table_labels_its_rows_and_columns_in_the_language(lang):
    report = nodes_report(load_runs(NODES / "missing_1.json"), lang)
    text = nodes_text(report, lang)
    rows = table_rows(text)
    assert [row[0] for row in rows] == LABELS[lang]
    assert f"{NODE[lang]} 0" in text and f"{NODE[lang]} 1" in text
    # Node 1 never joined: every fact cell says so; its problem is named by cause id.
    assert [row[2] for row in rows[:-1]] == [NEVER_JOINED[lang]] * (len(LABELS[lang]) - 1)
    assert rows[-1][2] == "world-size-mismatch"
    assert rows[0][1] and rows[3][1].startswith("2.")  # node 0's host name and torch version
    if lang == "zh":
        assert not any(word in text for word in ENGLISH_ONLY), text


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_node_that_could_not_join_says_so_in_the_language(lang):
    report = [{"node_rank": 1, "joined": False, "error": "rendezvous at h:1 timed out"}]
    rows = table_rows(nodes_text(report, lang))
    assert [row[1] for row in rows[:-1]] == [COULD_NOT_JOIN[lang]] * (len(LABELS[lang]) - 1)
    assert rows[-1] == [LABELS[lang][-1], "-"]


def test_one_machine_prints_no_nodes_table():
    for report in (None, []):
        text = nodes_text(report, "en")
        assert "node 0" not in text and "never joined" not in text
