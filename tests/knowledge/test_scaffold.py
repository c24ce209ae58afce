"""`assistant kb new`: a cause scaffolded from a real report.

The proposed signature must pass `kb lint`'s rules, match the report's root
error and still match when the parts that vary (paths, numbers, hosts, hex
ids) change; the file must fail `kb lint` on its TODO sections and on nothing
else; the command never overwrites and points out the nearest causes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from assistant import config
from assistant.clean import clean_log
from assistant.cli import main
from assistant.cli.kbtools import target_folder
from assistant.knowledge.kb import KBError, load_kb
from assistant.knowledge.patterns import compile_signature
from assistant.knowledge.scaffold import TODO_TEXT, draft_cause, generalise

REPO = Path(__file__).resolve().parents[2]
LOGS = sorted((REPO / "tests/data/logs").glob("*.txt"))
DUPLICATE_GPU = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:317, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
    "2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
)
PEER_ACCESS_LOG = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/u/train.py", line 12, in <module>
[rank1]:     dist.barrier()
[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3
[rank1]: ncclUnhandledCudaError: Call to CUDA function failed.
[rank1]: Last error:
[rank1]: Cuda failure 'peer access is not supported between these two devices'
"""
# Every field kb new leaves for a person, and what kb lint says of it.
TODO_PROBLEMS = {key: "must not be empty" for key in TODO_TEXT} | {
    "references": "needs at least one entry",
}


@pytest.mark.parametrize(
    ("line", "variant"),
    [
        (
            (
                "[/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by "
                "peer [127.0.0.1]:20637"
            ),
            (
                "[/opt/build/gloo/transport/tcp/pair.cc:590] Connection closed by peer "
                "[10.0.3.17]:41211"
            ),
        ),
        (
            (
                "The client socket has timed out after 1800000ms while trying to connect to "
                "(gpu-node-12.cluster.local, 29500)."
            ),
            (
                "The client socket has timed out after 600000ms while trying to connect to "
                "(dgx-a.internal, 23456)."
            ),
        ),
        (
            "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
            "Duplicate GPU detected : rank 3 and rank 2 both on CUDA device 4f000",
        ),
        (
            "exitcode: -9 (traceback : Signal 9 (SIGKILL) received by PID 4923)",
            "exitcode: -9 (traceback : Signal 9 (SIGKILL) received by PID 118)",
        ),
        (
            "CUDA error: an illegal memory access at 0x7f3a2c000000 on host node=worker3",
            "CUDA error: an illegal memory access at 0x7ffe10 on host node=gpu-b.lab",
        ),
    ],
)
def test_generalised_signature_matches_other_runs(line, variant):
    signature = compile_signature(generalise(line))
    assert signature.search(line).group(0) == line
    assert signature.search(variant) is not None


def test_fixed_words_stay_literal():
    pattern = generalise("NCCL version 2.21.5 (c10d) expected 1 got 2? [x]")
    assert pattern == r"NCCL version \d+\.\d+\.\d+ \(c10d\) expected \d+ got \d+\? \[x\]"


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.stem)
def test_signature_from_each_real_log_matches_its_root_error(log):
    text = log.read_text("utf-8")
    draft = draft_cause("from-a-log", text, log.name)
    root = clean_log(text).root_error
    assert draft.root_error == root and root is not None
    assert compile_signature(draft.signature).search(f"{root.type}: {root.message}")
    assert draft.matched and draft.matched in f"{root.type}: {root.message}"


def test_nccl_last_error_is_the_signature():
    draft = draft_cause("gpu-clash", DUPLICATE_GPU)
    assert draft.signature == (
        r"Duplicate GPU detected : rank \d+ and rank \d+ both on CUDA device [0-9a-f]+"
    )


def write_draft(folder: Path, cause_id: str, report: str) -> Path:
    path = folder / "causes" / f"{cause_id}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(draft_cause(cause_id, report, "report.txt").yaml, encoding="utf-8")
    return path


def lint_problems(team: Path) -> dict[str, str]:
    """{field: message} of kb lint over the built-in KB plus `team`."""
    with pytest.raises(KBError) as raised:
        load_kb([REPO / "kb", team])
    found = {}
    for problem in raised.value.problems:
        _, field, message = problem.split(": ", 2)
        found[field] = message
    return found


def test_scaffold_fails_lint_on_its_todos_only(tmp_path):
    write_draft(tmp_path, "peer-access-unsupported", PEER_ACCESS_LOG)
    expected = TODO_PROBLEMS | {"symptoms": "needs at least one symptom in Chinese"}
    assert lint_problems(tmp_path) == expected


def test_a_chinese_report_leaves_no_symptom_todo(tmp_path):
    path = write_draft(tmp_path, "zh-report", "DDP 一直报错找不到设备\n" + DUPLICATE_GPU)
    assert lint_problems(tmp_path) == TODO_PROBLEMS
    assert "# TODO: add a symptom in Chinese" not in path.read_text("utf-8")


def test_written_todos_make_it_pass_lint(tmp_path):
    path = write_draft(tmp_path, "peer-access-unsupported", PEER_ACCESS_LOG)
    text = path.read_text("utf-8")
    for key in TODO_TEXT:  # what a person writes
        text = re.sub(rf"^{key}: ''  # TODO.*$", f"{key}: written {key}", text, flags=re.MULTILINE)
    text = text.replace(
        "references: []  # TODO", "references: [{title: NCCL, url: 'https://nvidia.com'}]  #"
    )
    path.write_text(text, encoding="utf-8")
    data = yaml.safe_load(text)
    data["symptoms"].append("两张卡之间不支持 peer access")
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    kb = load_kb([REPO / "kb", tmp_path])
    cause = kb.causes["peer-access-unsupported"]
    assert cause.signatures == [
        r"Cuda failure 'peer access is not supported between these two devices'"
    ]
    assert cause.symptoms[0] == PEER_ACCESS_LOG.strip()  # the report, as written


def test_report_without_an_error_line(tmp_path):
    draft = draft_cause("vague-question", "DDP hangs sometimes, no idea why")
    assert draft.signature is None and draft.root_error is None
    assert "signatures: []  # TODO" in draft.yaml
    assert yaml.safe_load(draft.yaml)["symptoms"] == ["DDP hangs sometimes, no idea why"]


def test_a_long_log_gives_its_focus_as_symptom():
    log = (REPO / "tests/data/logs/value_error_rank1_then_peer_closed.txt").read_text("utf-8")
    assert len(log) > 1000
    symptom = yaml.safe_load(draft_cause("long-log", log).yaml)["symptoms"][0]
    assert symptom.startswith("ValueError: boom on rank one") and len(symptom) <= 1000


def test_target_folder_out_then_team_then_builtin(tmp_path, monkeypatch):
    monkeypatch.delenv("ASSISTANT_KB_PATH", raising=False)
    assert target_folder(None) == config.kb_dir()
    monkeypatch.setenv("ASSISTANT_KB_PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert target_folder(None) == tmp_path / "a"
    assert target_folder(tmp_path / "x") == tmp_path / "x"


# -- the command ---------------------------------------------------------------------


@pytest.fixture
def report(tmp_path) -> Path:
    path = tmp_path / "crash.log"
    path.write_text(DUPLICATE_GPU, encoding="utf-8")
    return path


def test_kb_new_writes_into_the_team_folder_and_names_the_nearest(private_engine, tmp_path, report):
    team = tmp_path / "team"
    team.mkdir()
    result = CliRunner().invoke(
        main, ["kb", "new", "acme-gpu-clash", "--from", str(report), "--kb", str(team)]
    )
    assert result.exit_code == 0, result.output
    written = team / "causes" / "acme-gpu-clash.yaml"
    assert f"wrote {written}" in result.output
    assert (
        "matches:  Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
        in result.output
    )
    nearest = result.output.split("is this one of these?")[1].splitlines()[1]
    assert nearest.split()[0] == "duplicate-gpu-per-rank"
    assert yaml.safe_load(written.read_text("utf-8"))["id"] == "acme-gpu-clash"


def test_kb_new_never_overwrites(private_engine, tmp_path, report):
    out = tmp_path / "team"
    args = ["kb", "new", "acme-gpu-clash", "--from", str(report), "--out", str(out)]
    assert CliRunner().invoke(main, args).exit_code == 0
    path = out / "causes" / "acme-gpu-clash.yaml"
    path.write_text("# my edits\n", encoding="utf-8")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "already exists; not overwriting it" in result.output
    assert path.read_text("utf-8") == "# my edits\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["duplicate-gpu-per-rank"], "already exists ("),
        (["Not An Id"], "invalid id 'Not An Id'"),
        (["fine-id", "--from", "/nonexistent/crash.log"], "cannot read /nonexistent/crash.log"),
        (["fine-id", "--from", "EMPTY"], "the report is empty"),
    ],
)
def test_kb_new_bad_input_is_one_line(tmp_path, report, args, message):
    empty = tmp_path / "empty.log"
    empty.write_text("  \n", encoding="utf-8")
    if "--from" not in args:
        args = [*args, "--from", str(report)]
    args = [str(empty) if a == "EMPTY" else a for a in args]
    result = CliRunner().invoke(main, ["kb", "new", *args, "--out", str(tmp_path / "t")])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.timeout(30)
def test_a_huge_line_without_a_slash_is_generalised_in_linear_time():
    # Every character of a long run used to start a new scan for a path's slash.
    line = "RuntimeError: " + "a" * 300_000 + " at /tmp/x 42"
    pattern = generalise(line)
    assert pattern.endswith(r"at \S+ \d+")
    assert re.search(pattern, line.replace("42", "7"))
