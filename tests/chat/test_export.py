"""The Markdown export of a conversation."""

from __future__ import annotations

import pytest

from assistant.chat.conversation import Conversation, Turn
from assistant.chat.export import conversation_markdown, fence, probe_facts
from assistant.results import CauseResult, Finding, ProbeRun, Result, RootError, Verdict

FIX_CODE = "local_rank = int(os.environ['LOCAL_RANK'])\ntorch.cuda.set_device(local_rank)\n"


def conversation() -> Conversation:
    causes = [
        CauseResult(
            "duplicate-gpu-per-rank",
            "Two ranks | one GPU",
            0.91,
            title_zh="多个 rank 在同一张卡上",
            fix="Give every rank its own GPU.",
            fix_code=FIX_CODE,
            verdict=Verdict("confirmed", ["rank 0 and rank 1 both on GPU-3f2a"], source="probe"),
        ),
        CauseResult(
            "set-device-order",
            "set_device after init",
            0.5,
            fix="Set the device first.",
            fix_code="torch.cuda.set_device(i)",
            verdict=Verdict("ruled_out", ["before init works here"], source="probe"),
        ),
        CauseResult(
            "local-rank-not-from-env",
            "LOCAL_RANK not read from the environment",
            0.3,
            verdict=Verdict("confirmed", ["train.py:12: argparse default 0"], source="script"),
        ),
        CauseResult(
            "nccl-not-available",
            "NCCL not built in",
            0.2,
            verdict=Verdict("confirmed", ["the error names it"], source="error"),
        ),
    ]
    probes = [
        ProbeRun(
            "devices",
            "ok",
            1.43,
            ranks=[
                {"rank": 0, "uuid": "GPU-3f2a", "count": 2, "env": {"CUDA_VISIBLE_DEVICES": "0"}},
                {"rank": 1, "uuid": "GPU-3f2a", "count": 2, "env": {"CUDA_VISIBLE_DEVICES": "1"}},
            ],
        ),
        ProbeRun("backend", "timeout", 60.0, detail="nccl all_reduce hung"),
    ]
    log = "banner\n[rank1]: RuntimeError: Duplicate GPU detected\nmore"
    result = Result(
        query=log,
        root_error=RootError("torch.distributed.DistBackendError", "Duplicate GPU detected", 1),
        causes=causes,
        probes=probes,
    )
    conv = Conversation()
    conv.add(Turn(query=log, result=result))
    conv.add(
        Turn(
            query="train.py",
            kind="lint",
            findings=[Finding("local-rank-not-from-env", 12, "argparse default 0", "train.py")],
        )
    )
    return conv


def test_export_has_root_error_verdicts_evidence_fix_environment_and_findings():
    text = conversation_markdown(conversation())
    assert text.startswith(
        "# DDP assistant report: torch.distributed.DistBackendError: Duplicate GPU detected\n"
    )
    assert (
        "## Root error (rank 1)\n\n```text\n"
        "torch.distributed.DistBackendError: Duplicate GPU detected\n```" in text
    )
    # Each verdict says where it comes from: only a probe "tested on this machine".
    assert (
        "| 1 | Two ranks \\| one GPU (`duplicate-gpu-per-rank`) "
        "| confirmed · tested on this machine | 0.91 |" in text
    )
    assert (
        "| 2 | set_device after init (`set-device-order`) "
        "| ruled out · tested on this machine | 0.50 |" in text
    )
    assert "| confirmed · your script, line 12 | 0.30 |" in text
    assert "| confirmed · the error says so | 0.20 |" in text
    assert "- rank 0 and rank 1 both on GPU-3f2a" in text
    # The fix of the confirmed cause only, as a Python block.
    assert "## Fix\n\n### Two ranks | one GPU (`duplicate-gpu-per-rank`)" in text
    assert "### LOCAL_RANK not read" in text  # every confirmed cause's fix
    assert "```python\n" + FIX_CODE.rstrip() + "\n```" in text
    assert "Set the device first." not in text
    # Environment facts: equal ones once, differing ones per rank.
    assert "- **devices**: ok, 1.4 s" in text
    assert "  - uuid: GPU-3f2a" in text and "  - count: 2" in text
    assert "  - env.CUDA_VISIBLE_DEVICES: rank 0=0, rank 1=1" in text
    assert "- **backend**: timeout, 60.0 s: nccl all_reduce hung" in text
    assert "- train.py:12 `local-rank-not-from-env`: argparse default 0" in text
    assert "## Questions asked\n\n1. banner (3 lines)" in text
    assert text.endswith("\n")


def test_without_a_confirmed_cause_the_best_ranked_fix_is_shown():
    conv = conversation()
    for cause in conv.turns[0].result.causes:
        cause.verdict = Verdict("inconclusive")
    text = conversation_markdown(conv)
    assert "### Two ranks | one GPU" in text and "Set the device first." not in text


def test_export_in_chinese_uses_chinese_headings_and_titles():
    text = conversation_markdown(conversation(), lang="zh")
    assert text.startswith("# DDP 助手报告")
    assert "## 根本错误" in text and "## 判定" in text and "## 修复方法" in text
    assert "多个 rank 在同一张卡上" in text and "已确认 · 已在本机测试" in text
    assert "已确认 · 你的脚本第 12 行" in text and "已确认 · 报错本身表明" in text


def test_a_conversation_without_answers_still_exports():
    conv = Conversation()
    conv.add(Turn(query="why?", error="Failed: index damaged"))
    text = conversation_markdown(conv)
    assert "No line of the text starts with an exception." in text
    assert "No answer yet." in text and "No probe has run yet." in text
    assert "## Fix" not in text


def test_fence_is_longer_than_any_backtick_run_inside():
    assert fence("a ``` b", "text") == "````text\na ``` b\n````"
    assert fence("plain") == "```\nplain\n```"


def test_probe_facts_are_capped():
    run = ProbeRun("system", "ok", 1.0, ranks=[{f"k{i}": i for i in range(40)}])
    lines = probe_facts(run, limit=5)
    assert lines[:5] == ["k0: 0", "k1: 1", "k2: 2", "k3: 3", "k4: 4"] and lines[5] == "… (+35)"


def test_a_report_goes_into_a_folder_or_to_a_named_file(tmp_path):
    from assistant.chat.export import write_report

    path = write_report("# r\n", tmp_path, now=1_700_000_000.0)
    assert path.parent == tmp_path and path.name.startswith("ddp-assistant-")
    assert path.read_text(encoding="utf-8") == "# r\n"
    named = write_report("# r\n", tmp_path / "crash.md", now=0.0)
    assert named == tmp_path / "crash.md" and named.is_file()


def test_an_unwritable_place_is_one_line_with_the_reason(tmp_path):
    from assistant.chat.export import ExportFailed, write_report

    with pytest.raises(ExportFailed) as failed:
        write_report("# r\n", tmp_path / "missing" / "folder", now=0.0)
    assert failed.value.reason == "No such file or directory"
    assert "\n" not in str(failed.value) and str(tmp_path / "missing") in str(failed.value)


def test_a_watched_launch_is_in_the_report_with_its_ranks_and_output():
    from assistant.chat.conversation import JobRecord

    conv = conversation()
    job = JobRecord.kept(
        output=["step 1", "[rank1]: ValueError: bad batch", "```"],
        ranks=["rank 0: waiting in all_reduce at train.py:40", "rank 1: ValueError at train.py:31"],
        seconds=4.25,
        note="exit 1",
    )
    conv.add(Turn(query="$ torchrun --nproc_per_node=2 train.py", job=job))
    text = conversation_markdown(conv, lang="zh")
    section = text.split("## 监视过的启动", 1)[1]
    assert "### `$ torchrun --nproc_per_node=2 train.py` (4.2 s)" in section
    assert "- rank 1: ValueError at train.py:31" in section and "exit 1" in section
    # The output's own backticks cannot close its fence.
    assert "````text\nstep 1\n[rank1]: ValueError: bad batch\n```\n````" in section


def test_a_conversation_without_launches_has_no_launch_section():
    assert "Launches watched" not in conversation_markdown(conversation(), lang="en")


def test_a_launch_heading_keeps_the_commands_pipes_and_backticks():
    from assistant.chat.conversation import JobRecord

    conv = conversation()
    query = "$ python -c 'print(\"a|b\")' `x`"
    conv.add(Turn(query=query, job=JobRecord.kept(["a|b"], [], seconds=1.0)))
    text = conversation_markdown(conv, lang="en")
    # A backslash is literal inside a code span: the pipe is not escaped; the
    # command's own backtick cannot close the span (nor touch its delimiters).
    assert f"### `` {query} `` (1.0 s)" in text
