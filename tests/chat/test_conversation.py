"""The conversation model: follow-up context, reusable probe runs, round trips."""

from __future__ import annotations

from assistant.chat.conversation import (
    Conversation,
    Turn,
    first_line,
    result_from_dict,
    result_to_dict,
)
from assistant.i18n import short
from assistant.results import (
    AnswerRef,
    CauseResult,
    Finding,
    ProbeRun,
    Result,
    RootError,
    Verdict,
)

ROOT = RootError("torch.distributed.DistBackendError", "Duplicate GPU detected", rank=1)


def cause(cause_id: str, verdict: str = "not_run", evidence=()) -> CauseResult:
    return CauseResult(
        id=cause_id,
        title=f"Title of {cause_id}",
        score=0.5,
        verdict=Verdict(verdict, list(evidence)),
    )


def answered(query: str, root=None, causes=(), probes=()) -> Turn:
    return Turn(
        query=query,
        result=Result(query=query, root_error=root, causes=list(causes), probes=list(probes)),
    )


def test_a_first_question_has_no_context():
    conversation = Conversation()
    assert conversation.context() is None
    conversation.add(answered("hello", causes=[cause("a", "ruled_out")]))
    assert conversation.context() is None  # nothing learned: no root error, nothing confirmed


def test_context_carries_the_earlier_root_error_and_confirmed_causes_only():
    conversation = Conversation()
    conversation.add(
        answered(
            "log",
            root=ROOT,
            causes=[
                cause("duplicate-gpu-per-rank", "confirmed"),
                cause("set-device-order", "ruled_out"),
                cause("master-endpoint-mismatch", "inconclusive"),
            ],
        )
    )
    context = conversation.context()
    assert context == (
        "Earlier root error: torch.distributed.DistBackendError: Duplicate GPU detected (rank 1). "
        "Confirmed on this machine: Title of duplicate-gpu-per-rank (duplicate-gpu-per-rank)."
    )
    assert "set-device-order" not in context and "master-endpoint" not in context


def test_context_before_a_turn_ignores_that_turn_and_later_ones():
    conversation = Conversation()
    conversation.add(answered("first", causes=[cause("a", "confirmed")]))
    index = conversation.add(answered("second", root=ROOT, causes=[cause("b", "confirmed")]))
    context = conversation.context(before=index)
    assert "(a)" in context and "(b)" not in context and "Earlier root error" not in context


def test_a_later_verdict_replaces_an_earlier_one():
    conversation = Conversation()
    conversation.add(answered("first", causes=[cause("a", "confirmed")]))
    conversation.add(answered("second", causes=[cause("a", "ruled_out")]))
    assert conversation.confirmed() == []


def test_long_root_errors_are_cut_in_the_context():
    conversation = Conversation()
    conversation.add(answered("x", root=RootError("RuntimeError", "y" * 5000)))
    assert len(conversation.context()) < 400


def test_title_prefers_the_root_error_then_the_first_question():
    conversation = Conversation()
    assert conversation.title == ""
    conversation.add(Turn(query="doctor", kind="doctor"))
    assert conversation.title == "doctor"
    conversation.add(Turn(query="\n\n  why does DDP hang?\nmore"))
    assert conversation.title == "why does DDP hang?"
    conversation.add(answered("log", root=ROOT))
    assert conversation.title == "torch.distributed.DistBackendError: Duplicate GPU detected"


def test_findings_come_from_the_latest_lint_of_each_script():
    old = Finding("missing-main-guard", 3, "old", "train.py")
    new = Finding("local-rank-not-from-env", 9, "new", "train.py")
    other = Finding("hardcoded-device", 1, "other", "eval.py")
    conversation = Conversation()
    conversation.add(Turn(query="train.py", kind="lint", findings=[old]))
    conversation.add(Turn(query="eval.py", kind="lint", findings=[other]))
    conversation.add(Turn(query="train.py", kind="lint", findings=[new]))
    conversation.add(Turn(query="gone.py", kind="lint", error="gone.py: no such file"))
    assert conversation.findings() == [new, other]


def test_a_clean_lint_counts_as_a_checked_script_and_a_failed_one_does_not():
    conversation = Conversation()
    conversation.add(Turn(query="gone.py", kind="lint", error="gone.py: no such file"))
    assert not conversation.script_checked()
    conversation.add(Turn(query="train.py", kind="lint", findings=[]))
    assert conversation.script_checked() and conversation.findings() == []


def test_only_finished_probe_runs_are_reused_and_the_latest_wins():
    conversation = Conversation()
    conversation.add(
        answered(
            "a",
            probes=[
                ProbeRun("devices", "ok", 1.0, ranks=[{"uuid": "old"}]),
                ProbeRun("backend", "timeout", 60.0),
                ProbeRun("set_device_order", "not_applicable", 0.2),
            ],
        )
    )
    conversation.add(
        answered("b", probes=[ProbeRun("devices", "ok", 2.0, ranks=[{"uuid": "new"}])])
    )
    runs = conversation.probe_runs()
    assert sorted(runs) == ["devices", "set_device_order"]
    assert runs["devices"].ranks == [{"uuid": "new"}]


def test_a_conversation_survives_a_round_trip_with_every_field():
    answer = AnswerRef(
        text="把set_device放到init_process_group后面",
        lang="zh",
        thread="seed-000",
        stance="wrong",
        note="the probe decides",
        answer_id="a2",
        advice="set-device-after-init",
        contradicts=["a8"],
        question="DDP 一直报错找不到设备",
        here="refuted_here",
    )
    full = CauseResult(
        id="set-device-order",
        title="t",
        title_zh="标题",
        score=0.9,
        summary="s",
        summary_zh="摘要",
        fix="f",
        fix_code="torch.cuda.set_device(local_rank)",
        probes=["set_device_order"],
        answers=[answer],
        signals={"signature": 1, "dense": 3},
        verdict=Verdict(
            "confirmed", ["after init fails"], refutes=["set-device-after-init"], source="probe"
        ),
    )
    result = Result(
        query="q",
        root_error=ROOT,
        causes=[full],
        probes=[
            ProbeRun("set_device_order", "ok", 3.2, ranks=[{"rank": 0, "ok": True}], detail="d")
        ],
        lang="zh",
        confidence="medium",
        decide=["nvidia-smi"],
        answer_id="ans-1",
    )
    conversation = Conversation(id=7, created=123.0)
    conversation.add(Turn(query="q", lang="zh", result=result, created=124.0))
    conversation.add(
        Turn(query="t.py", kind="lint", findings=[Finding("hardcoded-device", 2, "m", "t.py")])
    )
    conversation.add(Turn(query="bad", error="Failed: boom"))
    assert Conversation.from_dict(conversation.to_dict()) == conversation


def test_result_from_dict_ignores_keys_it_does_not_know():
    data = result_to_dict(Result(query="q", root_error=ROOT, causes=[cause("a", "confirmed")]))
    data["future"] = 1
    data["causes"][0]["future_field"] = "x"
    data["root_error"]["column"] = 3
    result = result_from_dict(data)
    assert result.causes[0].verdict.verdict == "confirmed" and result.root_error == ROOT


def test_text_helpers():
    assert first_line("\n  \n  hello \nworld") == "hello"
    assert first_line("   ") == ""
    assert short("a  b\nc", 10) == "a b c"
    assert short("abcdefghijk", 5) == "abcd…"


def test_a_reply_to_the_decide_question_carries_the_earlier_question():
    conversation = Conversation()
    unsure = answered("DDP keeps saying it can't find the device", causes=[cause("a")])
    unsure.result.confidence, unsure.result.decide = "low", ["nvidia-smi while the job runs"]
    conversation.add(unsure)
    context = conversation.context()
    assert context == "Earlier question: DDP keeps saying it can't find the device"
    assert conversation.asked_to_decide() is unsure
    assert [c.id for c in conversation.earlier_answer()] == ["a"]  # averaged with the reply's
    assert conversation.previous_answer() == []  # merged as a reply already
    asked = conversation.follow_up()  # what the chat, ask --after and kb eval put in the question
    assert asked["context"] == context and [c.id for c in asked["earlier"]] == ["a"]
    assert asked["previous"] == []
    # A sure answer asks nothing: the next question carries no context, and its
    # causes are merged only into a reply without an error of its own (pipeline).
    unsure.result.confidence, unsure.result.decide = "high", []
    assert conversation.context() is None and conversation.asked_to_decide() is None
    assert conversation.earlier_answer() == []
    assert [c.id for c in conversation.previous_answer()] == ["a"]
    asked = conversation.follow_up()
    assert asked["earlier"] == [] and [c.id for c in asked["previous"]] == ["a"]
