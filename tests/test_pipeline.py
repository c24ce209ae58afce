"""The one flow (assistant.pipeline): real KB, index and model; probe facts replayed
from machines recorded in tests/fixtures/facts/ (the runner is tested on its own
with real torchrun in tests/probing/)."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest

from assistant.errors import UserError
from assistant.pipeline import Observer, Pipeline, Question
from assistant.probing.recorded import RecordedRunner
from assistant.results import Finding

FACTS = Path(__file__).parent / "fixtures" / "facts"
PG_ERROR = (
    "RuntimeError: Default process group has not been initialized, "
    "please make sure to call init_process_group."
)
DUPLICATE_GPU = (
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
    "invalid usage, NCCL version 2.20.5\nncclInvalidUsage: This usually reflects invalid "
    "usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both "
    "on CUDA device 1a000"
)

pytestmark = pytest.mark.slow


class SlowEngine:
    """The real engine, answering only once the probe launch has started."""

    def __init__(self, engine, runner: RecordedRunner):
        self.engine, self.runner = engine, runner

    def ask(self, query, top=5, context=None):
        assert self.runner.started.wait(30), "the probe launch did not start before retrieval"
        return self.engine.ask(query, top=top, context=context)

    def signatures(self):
        return self.engine.signatures()


def test_ask_runs_the_whole_flow_and_returns_judged_causes(engine):
    runner = RecordedRunner(FACTS / "cpu_2ranks.json")
    result = Pipeline(engine=engine, runner=runner).ask(PG_ERROR)
    assert result.causes[0].id == "process-group-not-initialized"
    assert result.causes[0].verdict.verdict != "not_run"
    assert {run.name for run in result.probes} >= {"launch_env", "devices", "backend"}
    assert result.confidence in ("high", "medium", "low")


def test_the_probe_launch_starts_before_retrieval_ends(engine):
    runner = RecordedRunner(FACTS / "cpu_2ranks.json")
    pipeline = Pipeline(engine=SlowEngine(engine, runner), runner=runner)
    result = pipeline.ask(PG_ERROR)  # SlowEngine fails the test if probes had not started
    assert result.probes and len(runner.calls) == 1


def test_causes_are_reported_before_probe_progress(engine):
    runner = RecordedRunner(FACTS / "cpu_2ranks.json")
    events: list[str] = []
    observer = Observer(
        on_causes=lambda result: events.append(f"causes:{result.causes[0].verdict.verdict}"),
        on_probe=lambda event: events.append(f"probe:{event.state}"),
    )
    Pipeline(engine=engine, runner=runner).ask(PG_ERROR, observer)
    assert "causes:not_run" in events and any(e.startswith("probe:") for e in events)
    assert events.count("causes:not_run") == 1


def test_ask_never_changes_what_it_was_given(engine):
    pipeline = Pipeline(engine=engine, runner=RecordedRunner(FACTS / "two_ranks_one_gpu.json"))
    ranked = engine.ask(DUPLICATE_GPU)
    before = copy.deepcopy(ranked)
    runs = pipeline.runner.run(["devices", "launch_env"])
    judged = pipeline.judge(ranked, runs)
    assert ranked == before
    assert judged is not ranked
    assert judged.causes[0].verdict.verdict == "confirmed"


def test_known_runs_are_reused_not_relaunched(engine):
    runner = RecordedRunner(FACTS / "cpu_2ranks.json")
    pipeline = Pipeline(engine=engine, runner=runner)
    first = pipeline.ask(PG_ERROR)
    second = pipeline.ask(Question(DUPLICATE_GPU, known_runs=first.probes))
    assert len(runner.calls) == 1
    assert {r.name for r in second.probes} == {r.name for r in first.probes}


def test_without_a_runner_every_verdict_rests_on_text_or_script(engine):
    finding = Finding("process-group-not-initialized", 3, "dist.barrier() before init")
    result = Pipeline(engine=engine).ask(Question(PG_ERROR, findings=[finding]))
    first = result.causes[0]
    assert first.id == "process-group-not-initialized"
    assert first.verdict.verdict == "confirmed" and first.verdict.source == "script"
    assert not result.probes


def test_a_failed_retrieval_cancels_the_early_launch(engine):
    seen: list[threading.Event] = []

    class Waiting(RecordedRunner):
        def run(self, names, on_progress=None, cancel=None):
            seen.append(cancel)
            cancel.wait(30)
            return []

    class Broken:
        def ask(self, query, top=5, context=None):
            while not seen:
                threading.Event().wait(0.01)
            raise UserError("index damaged")

        def signatures(self):
            return {}

    with pytest.raises(UserError):
        Pipeline(engine=Broken(), runner=Waiting(FACTS / "cpu_2ranks.json")).ask(PG_ERROR)
    assert seen[0].wait(5), "the launch was left running"


def test_an_empty_question_is_a_user_error(engine):
    with pytest.raises(UserError):
        Pipeline(engine=engine).ask("   ")


def test_doctor_judges_every_contract_cause_with_no_question():
    from assistant.config import contract_ids

    result = Pipeline(runner=RecordedRunner(FACTS / "two_ranks_one_gpu.json")).doctor()
    assert {c.id for c in result.causes} >= set(contract_ids())
    assert result.query is None and result.confidence is None
    assert result.causes[0].verdict.verdict == "confirmed"


def test_confidence_is_high_when_a_signature_names_the_error(engine):
    result = Pipeline(engine=engine).ask(DUPLICATE_GPU)
    assert result.confidence == "high" and result.decide == []


def test_an_unsure_answer_says_what_would_decide_in_the_users_language(engine):
    result = Pipeline(engine=engine).ask("DDP 训练卡住了，不知道为什么")
    assert result.confidence in ("medium", "low")
    assert result.decide and all(any("\u4e00" <= ch <= "\u9fff" for ch in d) for d in result.decide)
    english = Pipeline(engine=engine).ask("my DDP training just hangs, no error at all")
    assert english.decide and not any(
        "\u4e00" <= ch <= "\u9fff" for d in english.decide for ch in d
    )


def test_a_cause_a_finding_proves_joins_the_answer_and_leads(engine):
    # The words say "timeout"; lint found a collective only rank 0 reaches.
    finding = Finding("collective-mismatch", 12, "all_reduce only on rank 0", "train.py")
    text = "my DDP job hangs at the end of the first epoch and then the watchdog times out"
    result = Pipeline(engine=engine).ask(Question(text, top=2, findings=[finding]))
    first = result.causes[0]
    assert first.id == "collective-mismatch"
    assert (first.verdict.verdict, first.verdict.source) == ("confirmed", "script")


def test_a_finding_the_root_error_does_not_point_to_joins_but_does_not_lead(engine):
    # Unused parameters in the script, beside an NCCL system error: true of the
    # script, and shown, but not this error's explanation.
    finding = Finding("unused-parameters", 40, "a head skipped on some steps", "train.py")
    text = (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3"
    )
    result = Pipeline(engine=engine).ask(Question(text, top=3, findings=[finding]))
    ids = [cause.id for cause in result.causes]
    assert "unused-parameters" in ids and ids[0] != "unused-parameters"
    joined = result.causes[ids.index("unused-parameters")]
    assert (joined.verdict.verdict, joined.verdict.source) == ("confirmed", "script")


def test_code_pasted_into_the_question_is_linted_and_quoted_as_the_evidence(engine):
    text = (
        "accelerator.wait_for_everyone() stuck when saving the checkpoint\n"
        "\n"
        "```python\n"
        "for step, batch in enumerate(loader):\n"
        "    if accelerator.is_main_process and step % 500 == 0:\n"
        "        accelerator.wait_for_everyone()\n"
        "        accelerator.save_state(output_dir)\n"
        "```\n"
    )
    question = Question(text, top=3)
    result = Pipeline(engine=engine).ask(question)
    first = result.causes[0]
    assert first.id == "collective-mismatch"
    assert (first.verdict.verdict, first.verdict.source) == ("confirmed", "script")
    assert first.verdict.evidence[0].startswith("the code in the question, line 6: ")
    assert question.findings == ()  # the caller's question is not changed


def test_a_reply_is_averaged_with_the_answer_that_asked_for_it():
    from assistant.pipeline import with_earlier_answer
    from assistant.results import CauseResult, Result, Verdict

    def causes(*scored):
        return [CauseResult(id=cid, title=cid, score=score) for cid, score in scored]

    earlier = causes(("checkpoint-map-location", 0.8), ("set-device-order", 0.6))
    earlier[0].verdict = Verdict("confirmed", ["from the earlier turn"])
    reply = Result(
        query="24G each", root_error=None, causes=causes(("oom", 0.5), ("set-device-order", 0.45))
    )
    merged = with_earlier_answer(reply, earlier, top=2)
    # (earlier + REPLY_WEIGHT x reply) / (1 + REPLY_WEIGHT), the best two kept
    assert [(c.id, round(c.score, 3)) for c in merged.causes] == [
        ("checkpoint-map-location", 0.64),  # 0.8 / 1.25: the reply did not rank it
        ("set-device-order", 0.57),  # (0.6 + 0.25 x 0.45) / 1.25
    ]
    assert [c.id for c in reply.causes] == ["oom", "set-device-order"]
    assert merged.causes[0].verdict.verdict == "not_run"  # judged afresh in this turn
    assert earlier[0].verdict.verdict == "confirmed"


def test_a_reply_whose_first_cause_names_its_own_error_stands_alone():
    from assistant.pipeline import with_earlier_answer
    from assistant.results import CauseResult, Result, RootError

    earlier = [CauseResult(id="single-process-launch", title="s", score=0.9)]
    named = CauseResult(id="process-group-not-initialized", title="p", score=1.0)
    named.signals, named.root_hit = {"signature": 1}, True
    other = CauseResult(id="launched-without-torchrun", title="l", score=0.2)
    error = RootError(type="RuntimeError", message="Default process group has not been initialized")
    reply = Result(query="the full log", root_error=error, causes=[named, other])
    decided = with_earlier_answer(reply, earlier, top=5)
    # the reply's own ranking and scores: the earlier guess no longer weighs against it
    assert [(c.id, c.score) for c in decided.causes] == [
        ("process-group-not-initialized", 1.0),
        ("launched-without-torchrun", 0.2),
    ]
    # a root error its first cause only resembles is merged as before
    named.signals = {"lexical": 1}
    merged = with_earlier_answer(reply, earlier, top=5)
    assert merged.causes[0].id == "single-process-launch"


def test_a_thin_reply_keeps_what_the_first_report_found(engine):
    from assistant.chat.conversation import Conversation, Turn

    pipeline = Pipeline(engine=engine)
    first = pipeline.ask(Question("GPU 0 uses much more memory than the other GPUs", top=5))
    assert first.confidence != "high" and first.decide
    conversation = Conversation(turns=[Turn(query=first.query, result=first)])
    reply = "I tried to disable some NCCL features but it doesn't work"
    alone = pipeline.ask(Question(reply, top=5, context=conversation.context()))
    both = pipeline.ask(Question(reply, top=5, **conversation.follow_up()))
    assert alone.causes[0].id != first.causes[0].id  # the reply alone lost the report
    assert both.causes[0].id == first.causes[0].id
    # A reply that shows the error itself decides, whatever was ranked before.
    traceback = f'Traceback (most recent call last):\n  File "train.py", line 9\n{PG_ERROR}'
    decided = pipeline.ask(Question(traceback, top=5, **conversation.follow_up()))
    assert decided.causes[0].id == "process-group-not-initialized"


def test_a_reply_after_a_sure_answer_adds_to_it_unless_it_brings_its_own_error(engine):
    # A "high" answer asks nothing; a reply without an error of its own (a
    # config, "still the same") is more of that report, while a new traceback
    # is a new failure, ranked on its own.
    from assistant.chat.conversation import Conversation, Turn

    pipeline = Pipeline(engine=engine)
    first = pipeline.ask(Question(DUPLICATE_GPU, top=5))
    assert first.confidence == "high" and not first.decide
    conversation = Conversation(turns=[Turn(query=first.query, result=first)])
    assert conversation.earlier_answer() == [] and conversation.previous_answer()

    def ask(text):
        return pipeline.ask(Question(text, top=5, **conversation.follow_up()))

    config = "here is my config:\nbatch_size = 32\nlr = 0.0001\nepochs = 50\nfp16 = true"
    alone = pipeline.ask(Question(config, top=5, context=conversation.context()))
    assert alone.causes[0].id != first.causes[0].id  # the config alone is another answer
    assert ask(config).causes[0].id == first.causes[0].id
    traceback = f'Traceback (most recent call last):\n  File "train.py", line 9\n{PG_ERROR}'
    assert ask(traceback).causes[0].id == "process-group-not-initialized"
    assert len(ask(traceback).causes) == 5


def test_code_pasted_as_the_reply_to_what_would_decide_confirms_its_cause(engine):
    from assistant.chat.conversation import Conversation, Turn

    pipeline = Pipeline(engine=engine)
    first = pipeline.ask(Question("DDP training hangs at the end of the first epoch", top=5))
    assert first.confidence != "high" and first.decide
    conversation = Conversation(turns=[Turn(query=first.query, result=first)])
    reply = (
        "this is my validation:\n"
        "if dist.get_rank() == 0:\n"
        "    acc = evaluate(model, val_loader)\n"
        "    dist.all_reduce(acc)\n"
        "    print(acc)\n"
    )
    second = pipeline.ask(Question(reply, top=5, **conversation.follow_up()))
    cause = second.causes[0]
    assert (cause.id, cause.verdict.verdict) == ("collective-mismatch", "confirmed")
    assert cause.verdict.evidence[0].startswith("the code in the question, line 4: all_reduce()")
