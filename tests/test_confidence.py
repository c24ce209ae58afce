"""What an unsure answer asks for: every cause knows which evidence splits it from its neighbours."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from assistant.confidence import DECIDERS, EVIDENCE, assess, what_would_decide
from assistant.results import CauseResult, Result

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")


def kb_cause_ids() -> set[str]:
    return {path.stem for path in (ROOT / "kb" / "causes").glob("*.yaml")}


def test_every_built_in_cause_has_its_own_deciders():
    # A cause without an entry would fall back to "traceback + launch", which
    # says nothing about, say, a GPU's Xid errors or a file-descriptor limit.
    assert kb_cause_ids() <= set(DECIDERS)
    assert set(DECIDERS) <= kb_cause_ids(), "an entry for a cause the KB no longer has"


def test_every_decider_is_a_piece_of_evidence_in_both_languages():
    kinds = {kind for kinds in DECIDERS.values() for kind in kinds}
    assert kinds <= set(EVIDENCE)
    for kind, (_, english, chinese) in EVIDENCE.items():
        assert english and not CJK.search(english), kind
        assert CJK.search(chinese), kind


def unsure(*ids: str, query: str = "training fails", lang: str = "en") -> Result:
    causes = [CauseResult(id=cid, title=cid, score=0.5 - 0.05 * n) for n, cid in enumerate(ids)]
    return Result(query=query, root_error=None, causes=causes, lang=lang)


def test_the_first_causes_own_evidence_is_asked_for():
    decide = what_would_decide(unsure("too-many-open-files", "spawn-pickle-error"))
    assert any("ulimit -n" in line for line in decide)
    hardware = what_would_decide(unsure("gpu-hardware-fault", "cuda-out-of-memory"))
    assert any("xid" in line for line in hardware)
    # "ecc" inside a word (docker's seccomp) is not the GPU's ECC report
    docker = what_would_decide(
        unsure(
            "gpu-hardware-fault",
            "cuda-out-of-memory",
            query="run with --security-opt seccomp=unconfined",
        )
    )
    assert any("xid" in line for line in docker)
    given = what_would_decide(
        unsure(
            "gpu-hardware-fault",
            "cuda-out-of-memory",
            query="NVRM: Xid 79, GPU has fallen off the bus",
        )
    )
    assert not any("xid" in line for line in given)


@pytest.mark.parametrize(
    "query",
    [
        "GPU0 GPU1 CPU Affinity\nGPU0 X SYS\nGPU1 SYS X\ntraining hangs at the first all_reduce",
        "training hangs, here is nvidia-smi topo -m: all SYS",
    ],
)
def test_evidence_already_in_the_question_is_not_asked_again(query):
    decide = what_would_decide(unsure("p2p-hang", "collective-timeout", query=query))
    assert not any("topo -m" in line for line in decide)
    assert any("NCCL_DEBUG=INFO" in line for line in decide)


def test_code_already_pasted_is_not_asked_for_again_but_a_quoted_traceback_line_is_not_code():
    def asks_for_code(query: str) -> bool:
        decide = what_would_decide(unsure("hardcoded-device", "device-map-with-ddp", query=query))
        return any("training script" in line for line in decide)

    assert asks_for_code("only GPU 0 is used")
    assert not asks_for_code("only GPU 0 is used:\n```python\nmodel.to('cuda:0')\n```")
    assert not asks_for_code("only GPU 0 is used\nimport torch\nmodel = Net().cuda()")
    traceback = '  File "train.py", line 3, in <module>\n    from model import Net\nImportError'
    assert asks_for_code(f"only GPU 0 is used\n{traceback}")


def test_a_chinese_question_is_asked_in_chinese():
    result = assess(
        unsure("windows-libuv", "nccl-not-available", lang="zh", query="windows 上报错")
    )
    assert result.confidence == "low" and result.decide
    assert all(CJK.search(line) for line in result.decide)
    assert any("collect_env" in line for line in result.decide)


def test_a_launcher_summary_alone_asks_for_the_failing_ranks_traceback_first():
    summary = (
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) "
        "local_rank: 0 (pid: 1234) of binary: /usr/bin/python3"
    )
    decide = what_would_decide(unsure("master-endpoint-mismatch", "oom-killed", query=summary))
    assert decide[0] == EVIDENCE["traceback"][1] and len(decide) <= 3
    with_traceback = summary + "\nTraceback (most recent call last):\n  File 'train.py'"
    later = what_would_decide(
        unsure("master-endpoint-mismatch", "oom-killed", query=with_traceback)
    )
    assert EVIDENCE["traceback"][1] not in later


@pytest.mark.parametrize(
    ("query", "lang"),
    [
        ("Training stuck on initializing ddp with 4 GPUs; works on one GPU", "en"),
        ("DDP hangs after the first epoch, no error", "en"),
        ("单机多卡训练卡在第一个 epoch 不动，也没有报错", "zh"),
    ],
)
def test_a_hang_without_an_error_asks_where_each_rank_waits_first(query, lang):
    # Whatever the leading causes, the ranks' stacks under `assistant run` tell them apart.
    decide = what_would_decide(unsure("p2p-hang", "world-size-mismatch", query=query, lang=lang))
    assert decide[0] == EVIDENCE["run"][2 if lang == "zh" else 1]


def test_a_hang_with_its_traceback_is_not_sent_to_run_first():
    query = "it hangs, then after Ctrl+C:\nTraceback (most recent call last):\n  File 'train.py'"
    decide = what_would_decide(unsure("p2p-hang", "world-size-mismatch", query=query))
    assert decide[0] != EVIDENCE["run"][1]
    # words that merely contain a hang word are no hang
    assert not what_would_decide(unsure("p2p-hang", query="the changelog says"))[0].startswith(
        "where each rank waits"
    )


@pytest.mark.parametrize(
    ("lead", "signals", "root_hit", "level"),
    [
        (0.3, {"lexical": 1, "dense": 1}, False, "medium"),  # two word searches agree: words alone
        (0.15, {"lexical": 1, "dense": 1}, False, "medium"),  # they agree, the lead is small
        (0.3, {"lexical": 1, "dense": 2}, False, "low"),  # one search alone
        (0.3, {"signature": 1, "lexical": 4}, True, "high"),  # a signature in the root error
        (
            0.3,
            {"signature": 1, "lexical": 4},
            False,
            "low",
        ),  # one only in the body: a single signal
        (0.65, {"signature": 1, "lexical": 1}, False, "high"),  # in the body, and the words agree
        (0.3, {"signature": 1, "lexical": 1}, False, "medium"),  # ... but with a small lead
        (0.2, {"lexical": 1, "dense": 1, "reports": 1}, False, "high"),  # all three word signals
        (0.15, {"lexical": 1, "dense": 1, "reports": 1}, False, "high"),  # ... from 0.15 on
        (0.12, {"lexical": 1, "dense": 1, "reports": 1}, False, "medium"),  # ... a small lead
        (
            0.15,
            {"lexical": 3, "dense": 1, "reports": 1},
            False,
            "high",
        ),  # meaning and reports agree
        (0.3, {"lexical": 1, "dense": 1, "reports": 2}, False, "medium"),  # the reports disagree
        (0.3, {"lexical": 1, "dense": 2, "reports": 1}, False, "medium"),  # the meaning disagrees
    ],
)
def test_levels_rest_on_agreement_and_lead(lead, signals, root_hit, level):
    # The reports' model leads clearly wherever it ranks the first cause first.
    leads = {"reports": 0.5} if signals.get("reports") == 1 else {}
    first = CauseResult(
        id="p2p-hang", title="p2p-hang", score=0.6, signals=signals, root_hit=root_hit, leads=leads
    )
    second = CauseResult(id="collective-timeout", title="collective-timeout", score=0.6 - lead)
    result = Result(query="training hangs", root_error=None, causes=[first, second], lang="en")
    assert assess(result).confidence == level


@pytest.mark.parametrize(
    ("reports_lead", "level"),
    [(0.5, "high"), (0.25, "high"), (0.2, "medium"), (0.0, "medium")],
)
def test_meaning_agreeing_needs_the_reports_model_to_lead_clearly(reports_lead, level):
    first = CauseResult(
        id="p2p-hang",
        title="p2p-hang",
        score=0.6,
        signals={"lexical": 3, "dense": 1, "reports": 1},
        leads={"reports": reports_lead},
    )
    second = CauseResult(id="collective-timeout", title="collective-timeout", score=0.4)
    result = Result(query="training hangs", root_error=None, causes=[first, second], lang="en")
    assert assess(result).confidence == level


@pytest.mark.parametrize(
    ("first_signals", "level"),
    [({"signature": 1, "lexical": 4}, "low"), ({"signature": 1, "lexical": 1}, "medium")],
)
def test_two_causes_the_text_names_exactly_are_never_high(first_signals, level):
    # "found at least two devices" in the root error, and another cause's
    # signature in a line of the log: the text names two causes.
    first = CauseResult(
        id="hardcoded-device", title="", score=1.0, signals=first_signals, root_hit=True
    )
    second = CauseResult(
        id="launched-without-torchrun", title="", score=0.6, signals={"signature": 2}
    )
    result = Result(query="two devices", root_error=None, causes=[first, second], lang="en")
    assert assess(result).confidence == level
    alone = Result(
        query="two devices",
        root_error=None,
        causes=[first, CauseResult(id="launched-without-torchrun", title="", score=0.6)],
        lang="en",
    )
    assert assess(alone).confidence == "high"


def test_a_script_already_linted_is_not_asked_for_again():
    # `ask --script`, `assistant run` and a lint in the chat have the script:
    # a clean lint is an answer too, and asking for the file again reads as if
    # it was never looked at.
    ids = ("hardcoded-device", "device-map-with-ddp")
    asked = assess(unsure(*ids, query="only GPU 0 is used"))
    checked = assess(unsure(*ids, query="only GPU 0 is used"), script_checked=True)
    assert any("training script" in line for line in asked.decide)
    assert checked.decide and not any("training script" in line for line in checked.decide)
    assert checked.confidence == asked.confidence
