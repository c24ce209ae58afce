"""Fakes for the chat's dependencies, with the exact signatures of the real ones.

The Pilot and snapshot tests import these, and the helpers at the end that
drive the app (until, ask, run_command). The flow itself is the real
assistant.pipeline.Pipeline; only its verdict step is table-driven here
(TablePipeline), so the tests do not depend on how the verdict functions
read facts; the tests that pass `pipeline_type=Pipeline` use the real
verdicts on facts recorded on real machines. The tests at the bottom keep
the fakes honest by comparing their signatures with the real ones.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from textual import events

from assistant.confidence import assess
from assistant.errors import UserError
from assistant.i18n import detect_lang
from assistant.pipeline import Observer, Pipeline
from assistant.results import (
    VERDICT_RANK,
    AnswerRef,
    CauseResult,
    Finding,
    ProbeRun,
    Result,
    RootError,
    Verdict,
)

if TYPE_CHECKING:
    from assistant.tui.turn import TurnView

THREAD = "seed-000-ddp-cant-find-device"
DUPLICATE_GPU_LINE = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:317, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
    "2.21.5 ncclInvalidUsage: This usually reflects invalid usage of NCCL library. Last "
    "error: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
)
FIX_CODE = (
    'local_rank = int(os.environ["LOCAL_RANK"])\n'
    "torch.cuda.set_device(local_rank)\n"
    'dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))\n'
)


def multi_rank_log(lines: int = 500) -> str:
    """A torchrun log of about `lines` lines with the duplicate-GPU error on rank 1."""
    head = [
        "W1129 22:31:07.123000 4242 torch/distributed/run.py:793] ****************",
        "W1129 22:31:07.123000 4242 torch/distributed/run.py:793] Setting OMP_NUM_THREADS",
    ]
    body = [f"[rank0]:[I1129 22:31:{i % 60:02d}] step {i} loss 0.{i:04d}" for i in range(lines - 8)]
    tail = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/work/train.py", line 41, in <module>',
        "[rank1]:     dist.barrier()",
        f"[rank1]: {DUPLICATE_GPU_LINE}",
        "E1129 22:31:09.000000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]
    return "\n".join(head + body + tail)


THREAD_QUESTION = (
    "DDP 一直报错找不到设备，我只有一张卡，用 torchrun 启动两个进程，"
    "init_process_group 之前要不要先 torch.cuda.set_device？已经卡了两天了"
)


def _answers_duplicate() -> list[AnswerRef]:
    return [
        AnswerRef(
            text="先确认下 torchrun 有没有正确把 LOCAL_RANK 传进去，init_process_group 之前最好先 "
            "torch.cuda.set_device。",
            lang="zh",
            thread=THREAD,
            question=THREAD_QUESTION,
            stance="right",
            note="Matches the PyTorch docs.",
            answer_id="a8",
            advice="set-device-before-init",
            contradicts=["a2", "a7"],
        ),
        AnswerRef(
            text="我之前就是先设了set_device再初始化进程组，改成先初始化再设设备就通了。",
            lang="zh",
            thread=THREAD,
            question=THREAD_QUESTION,
            stance="partly_right",
            note="Reading LOCAL_RANK from os.environ is right; the order claim is not.",
            answer_id="a7",
            advice="set-device-after-init",
            contradicts=["a8"],
        ),
        AnswerRef(
            text="用 torch.cuda.device_count() 打印一下每个进程看到的卡数。",
            lang="zh",
            thread=THREAD,
            question=THREAD_QUESTION,
            stance="partly_right",
            answer_id="a4",
            advice="remove-set-device",
            contradicts=["a8"],
        ),
    ]


def sample_causes() -> list[CauseResult]:
    """Three candidate causes as retrieval returns them (verdicts not run)."""
    return [
        CauseResult(
            id="set-device-order",
            title="torch.cuda.set_device missing or after init_process_group",
            title_zh="set_device 缺失或在 init_process_group 之后",
            score=0.81,
            summary="NCCL builds its communicator on the wrong current device.",
            summary_zh="NCCL 在错误的当前设备上建立通信器。",
            fix="Set the device before init_process_group.",
            fix_code=FIX_CODE,
            probes=["set_device_order"],
            answers=_answers_duplicate(),
        ),
        CauseResult(
            id="duplicate-gpu-per-rank",
            title="Two or more ranks are on the same physical GPU",
            title_zh="多个进程（rank）落在同一张物理 GPU 上",
            score=0.74,
            summary="Several ranks ended up on one GPU, so NCCL refuses.",
            summary_zh="多个 rank 用了同一张卡。",
            fix="Give every rank its own GPU: read LOCAL_RANK.",
            fix_code=FIX_CODE,
            probes=["devices", "launch_env"],
            answers=_answers_duplicate(),
        ),
        CauseResult(
            id="master-endpoint-mismatch",
            title="Ranks disagree on MASTER_ADDR / MASTER_PORT",
            title_zh="各 rank 的 MASTER_ADDR / MASTER_PORT 不一致",
            score=0.40,
            summary="The rendezvous cannot complete.",
            summary_zh="无法完成 rendezvous。",
            fix="Let torchrun set the endpoint.",
            fix_code="# remove os.environ['MASTER_PORT'] = ... from the script\n",
            probes=["rendezvous"],
            answers=[],
        ),
    ]


def gloo_causes() -> list[CauseResult]:
    """What a follow-up about gloo retrieves."""
    return [
        CauseResult(
            id="nccl-with-cpu-tensors",
            title="NCCL backend used with CPU tensors",
            title_zh="NCCL 后端用在了 CPU 张量上",
            score=0.66,
            summary="gloo works with CPU tensors, NCCL does not.",
            summary_zh="gloo 支持 CPU 张量，NCCL 不支持。",
            fix="Use gloo for CPU tensors.",
            fix_code='dist.init_process_group("gloo")\n',
            probes=["backend"],
        ),
        *sample_causes()[1:2],
    ]


# A question the fake engine answers with an exact signature match far ahead
# of the rest: the confidence is high and no follow-up question is asked.
SURE_MARK = "[exact signature]"


def sure_causes() -> list[CauseResult]:
    duplicate, order = sample_causes()[1], sample_causes()[0]
    duplicate.score, duplicate.signals = 0.95, {"signature": 1, "lexical": 1}
    duplicate.root_hit = True  # the signature matched the root error itself
    order.score = 0.4
    return [duplicate, order]


CAUSE_ENTRIES = {
    "set-device-order": {
        "why": "NCCL binds its communicator to the current CUDA device at init.",
        "why_zh": "NCCL 在初始化时绑定当前 CUDA 设备。",
        "risks": "None when LOCAL_RANK is right.",
        "references": [
            {
                "title": "DDP tutorial",
                "url": "https://pytorch.org/tutorials/intermediate/ddp_tutorial.html",
            }
        ],
    },
    "duplicate-gpu-per-rank": {
        "why": "NCCL expects each communicator member on its own GPU.",
        "why_zh": "NCCL 要求每个成员在自己的 GPU 上。",
        "risks": "Launch at most as many processes as GPUs.",
        "references": [
            {"title": "torchrun", "url": "https://pytorch.org/docs/stable/elastic/run.html"}
        ],
    },
}


class FakeEngine:
    """Engine with fixed answers; `load` can be held until `release()`."""

    def __init__(self, hold_load: bool = False, fail_load: str | None = None):
        self._gate = threading.Event()
        if not hold_load:
            self._gate.set()
        self.fail_load = fail_load
        self._ready = False
        self.asked: list[tuple[str, int, str | None]] = []
        self.rebuilds = 0
        self.cause_calls: list[str] = []

    def release(self) -> None:
        self._gate.set()

    def load(self) -> None:
        self._gate.wait(30)
        if self.fail_load:
            raise RuntimeError(self.fail_load)
        self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready

    def ask(self, query: str, top: int = 5, context: str | None = None) -> Result:
        if not query or not query.strip():
            raise UserError("the question is empty: paste an error message or a log")
        self.asked.append((query, top, context))
        causes = gloo_causes() if "gloo" in query.lower() else sample_causes()
        if SURE_MARK in query:
            causes = sure_causes()
        root = None
        if "Duplicate GPU" in query:
            message = DUPLICATE_GPU_LINE.split(": ", 1)[1]
            root = RootError("torch.distributed.DistBackendError", message, rank=1)
        return Result(
            query=query, root_error=root, causes=causes[:top], lang=detect_lang(query[:20_000])
        )

    def signatures(self) -> dict[str, list[str]]:
        return {}

    def rebuild(self) -> str:
        self.rebuilds += 1
        self._ready = True
        return "3 causes, 1 thread, 12 vectors"

    def cause(self, cause_id: str) -> dict:
        self.cause_calls.append(cause_id)
        for cause in sample_causes() + gloo_causes():
            if cause.id == cause_id:
                entry = {
                    "id": cause.id,
                    "title": cause.title,
                    "title_zh": cause.title_zh,
                    "summary": cause.summary,
                    "summary_zh": cause.summary_zh,
                    "why": "",
                    "why_zh": "",
                    "fix": cause.fix,
                    "fix_zh": "",
                    "fix_code": cause.fix_code,
                    "risks": "",
                    "probes": list(cause.probes),
                    "references": [],
                    "signatures": [],
                }
                entry.update(CAUSE_ENTRIES.get(cause_id, {}))
                return entry
        raise UserError(f"unknown cause {cause_id!r}")


@dataclass
class FakeProgressEvent:
    """Same fields as assistant.probing.runner.ProgressEvent."""

    probe: str
    state: str
    elapsed: float
    status: str | None = None


# Facts a two-GPU machine reports when both ranks sit on one GPU.
GPU_FACTS = {
    "devices": [
        {"rank": 0, "local_rank": 0, "current_device": 0, "uuid": "GPU-3f2a"},
        {"rank": 1, "local_rank": 1, "current_device": 0, "uuid": "GPU-3f2a"},
    ],
    "launch_env": [
        {"rank": 0, "LOCAL_RANK": "0", "WORLD_SIZE": "2"},
        {"rank": 1, "LOCAL_RANK": "1", "WORLD_SIZE": "2"},
    ],
    "set_device_order": [{"rank": 0, "before_init": True, "after_init": False}],
    "rendezvous": [{"rank": 0, "master_port": 29500, "ok": True}],
    "backend": [{"rank": 0, "gloo": True, "nccl": True}],
    "versions": [{"rank": 0, "torch": "2.13.0", "cuda": "12.4", "nccl": "2.21.5"}],
}


class FakeRunner:
    """ProbeRunner stand-in: fixed outcomes, optional gate to hold probes 'running'.

    outcomes: probe name -> (status, seconds); missing names finish "ok" in 1.0 s.
    """

    def __init__(
        self,
        outcomes: dict[str, tuple[str, float]] | None = None,
        hold: bool = False,
        error: Exception | None = None,
    ):
        self.outcomes = outcomes or {}
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.error = error
        self.calls: list[list[str]] = []
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.returned = threading.Event()

    def release(self) -> None:
        self.gate.set()

    def run(
        self,
        names: list[str],
        on_progress: Callable | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ProbeRun]:
        self.calls.append(list(names))
        runs = []
        try:
            if self.error is not None:
                raise self.error
            for name in names:
                if cancel is not None and cancel.is_set():
                    runs.append(ProbeRun(name, "interrupted", 0.0))
                    continue
                if on_progress:
                    on_progress(FakeProgressEvent(name, "started", 0.0))
                self.started.set()
                while not self.gate.wait(0.02):
                    if cancel is not None and cancel.is_set():
                        break
                if cancel is not None and cancel.is_set():
                    self.cancelled.set()
                    run = ProbeRun(name, "interrupted", 0.5)
                else:
                    status, seconds = self.outcomes.get(name, ("ok", 1.0))
                    facts = GPU_FACTS.get(name, []) if status == "ok" else []
                    run = ProbeRun(name, status, seconds, ranks=copy.deepcopy(facts))
                if on_progress:
                    on_progress(FakeProgressEvent(name, "finished", run.seconds, run.status))
                runs.append(run)
            return runs
        finally:
            self.returned.set()


RECORDED_FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts"


class RecordedRunner:
    """Replays probe runs recorded on a real machine (tests/fixtures/facts/<scenario>.json).

    This is how the chat is tested against GPU machines this project does not have.
    """

    def __init__(self, scenario: str):
        path = RECORDED_FACTS / f"{scenario}.json"
        if not path.is_file():
            pytest.skip(f"no recorded facts {path.name}")
        data = json.loads(path.read_text(encoding="utf-8"))
        self.runs = {
            run["name"]: ProbeRun(
                run["name"],
                run["status"],
                run["seconds"],
                ranks=run.get("ranks", []),
                detail=run.get("detail", ""),
            )
            for run in data["runs"]
        }
        self.calls: list[list[str]] = []

    def run(
        self,
        names: list[str],
        on_progress: Callable | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ProbeRun]:
        self.calls.append(list(names))
        runs, elapsed = [], 0.0
        for name in names:
            recorded = self.runs.get(name) or ProbeRun(name, "error", 0.0, detail="not recorded")
            if on_progress:
                on_progress(FakeProgressEvent(name, "started", elapsed))
            elapsed += recorded.seconds
            if on_progress:
                on_progress(FakeProgressEvent(name, "finished", elapsed, recorded.status))
            runs.append(copy.deepcopy(recorded))
        return runs


def fake_probes_for(causes: list[CauseResult], limit: int | None = None) -> list[str]:
    """Same contract as assistant.verdicts.probes_for: linked probes, best cause first, once."""
    names: list[str] = []
    for cause in causes:
        names.extend(p for p in cause.probes if p not in names)
    return names[:limit] if limit is not None else names


def fake_apply_verdicts(result: Result, runs: list[ProbeRun], findings: list[Finding]) -> Result:
    """Table-driven stand-in for assistant.verdicts.apply_verdicts on GPU_FACTS (a new Result)."""
    judged = copy.deepcopy(result)
    by_name = {run.name: run for run in runs}
    for cause in judged.causes:
        cause.verdict = _judge(cause, by_name, findings)
        refuted = set(cause.verdict.refutes)
        for answer in cause.answers:
            if answer.advice and answer.advice in refuted:
                answer.here = "refuted_here"
    judged.causes.sort(key=lambda c: VERDICT_RANK[c.verdict.verdict])
    judged.probes = list(runs)
    return judged


def _judge(cause: CauseResult, runs: dict[str, ProbeRun], findings: list[Finding]) -> Verdict:
    own = [runs[p] for p in cause.probes if p in runs]
    evidence = [f"{f.path}:{f.line}: {f.message}" for f in findings if f.cause_id == cause.id]
    if evidence:  # the person's own script shows it: that outweighs this machine's facts
        return Verdict("confirmed", evidence, source="script")
    if any(run.status == "timeout" for run in own):
        names = ", ".join(r.name for r in own if r.status == "timeout")
        return Verdict("inconclusive", [f"probe {names} timed out", *evidence], source="probe")
    if cause.id == "duplicate-gpu-per-rank" and "devices" in runs and runs["devices"].ranks:
        uuids = {r["uuid"] for r in runs["devices"].ranks}
        if len(uuids) == 1:
            line = f"rank 0 and rank 1 both on {uuids.pop()}"
            return Verdict("confirmed", [line, *evidence], source="probe")
        return Verdict("ruled_out", ["every rank on its own GPU", *evidence], source="probe")
    if cause.id == "set-device-order" and "set_device_order" in runs:
        facts = runs["set_device_order"].ranks
        if facts and not facts[0]["after_init"]:
            return Verdict(
                "ruled_out",
                ["set_device before init_process_group works here; after it fails", *evidence],
                refutes=["set-device-after-init"],
                source="probe",
            )
    rendezvous = runs.get("rendezvous")
    if cause.id == "master-endpoint-mismatch" and rendezvous and rendezvous.status == "ok":
        line = "rendezvous on 127.0.0.1:29500 succeeded"
        return Verdict("ruled_out", [line, *evidence], source="probe")
    return Verdict("not_run") if not own else Verdict("inconclusive", [], source="probe")


DOCTOR_PROBES = ["launch_env", "devices", "backend", "versions"]


class TablePipeline(Pipeline):
    """The real Pipeline, its verdict step and doctor replaced by the table above."""

    def judge(self, result, runs, findings=(), script_checked=False):
        return assess(fake_apply_verdicts(result, list(runs), list(findings)), script_checked)

    def doctor(self, lang="en", observer=None, cancel=None):
        observer = observer or Observer()
        runs = self.runner.run(DOCTOR_PROBES, on_progress=observer.probe, cancel=cancel)
        result = Result(query=None, root_error=None, causes=sample_causes()[1:2], lang=lang)
        return fake_apply_verdicts(result, runs, [])


def fake_linter(path: str) -> list[Finding]:
    """Same contract as assistant.lint.script.lint_script."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such file")
    source = file.read_text(encoding="utf-8")
    findings = []
    for number, line in enumerate(source.splitlines(), 1):
        if re.search(r"default=0", line):
            findings.append(
                Finding("duplicate-gpu-per-rank", number, "local_rank defaults to 0", str(path))
            )
    return findings


class FixedClock:
    """A clock that moves only when told to (so snapshots show no moving time)."""

    def __init__(self, start: float = 1000.0):
        self.value = start

    def __call__(self) -> float:
        return self.value

    def advance(self, seconds: float) -> None:
        self.value += seconds


def fake_deps(
    engine: FakeEngine | None = None,
    runner=None,
    history=None,
    lang: str | None = None,
    clock: Callable[[], float] | None = None,
    export_dir: Path | None = None,
    pipeline_type=TablePipeline,
    **options,
):
    """The chat's dependencies from the one factory, around the fakes above."""
    from assistant.tui.deps import chat_deps

    return chat_deps(
        engine=engine or FakeEngine(),
        runner=runner or FakeRunner(),
        lint=fake_linter,
        history=history,
        pipeline_type=pipeline_type,
        lang=lang,
        clock=clock or FixedClock(),
        now=lambda: 1_700_000_000.0,
        export_dir=export_dir,
        cursor_blink=False,
        format_time=lambda stamp: time.strftime("%Y-%m-%d %H:%M", time.gmtime(stamp)),
        **options,
    )


def fake_app(**kwargs):
    """The real chat app over fake_deps(**kwargs)."""
    from assistant.tui.app import make_app

    return make_app(fake_deps(**kwargs))


# -- the fakes follow the real signatures ---------------------------------------------


def _parameters(function) -> list[tuple[str, object]]:
    return [
        (p.name, p.default)
        for p in inspect.signature(function).parameters.values()
        if p.name != "self"
    ]


def _real(module: str, name: str):
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{module}.{name} is not written yet")


@pytest.mark.parametrize("method", ["load", "ask", "rebuild", "cause", "signatures"])
def test_fake_engine_matches_engine(method):
    engine_class = _real("assistant.knowledge.engine", "Engine")
    real = _parameters(getattr(engine_class, method))
    fake = _parameters(getattr(FakeEngine, method))
    # The real ask may take extra keyword options after the shared ones.
    assert real[: len(fake)] == fake
    assert isinstance(inspect.getattr_static(engine_class, "ready"), property)


def test_fake_runner_matches_probe_runner():
    runner_class = _real("assistant.probing.runner", "ProbeRunner")
    assert _parameters(runner_class.run) == _parameters(FakeRunner.run)
    event_class = _real("assistant.probing.runner", "ProgressEvent")
    assert list(inspect.signature(event_class).parameters)[:4] == [
        "probe",
        "state",
        "elapsed",
        "status",
    ]


@pytest.mark.parametrize(
    ("module", "name", "fake"),
    [
        ("assistant.verdicts", "apply_verdicts", fake_apply_verdicts),
        ("assistant.lint.script", "lint_script", fake_linter),
    ],
)
def test_fake_functions_match_real(module, name, fake):
    real = _real(module, name)
    real_names = [n for n, _ in _parameters(real)]
    fake_names = [n for n, _ in _parameters(fake)]
    assert real_names[: len(fake_names)] == fake_names


@pytest.mark.parametrize("method", ["judge", "doctor"])
def test_the_table_pipeline_keeps_the_pipeline_signatures(method):
    assert _parameters(getattr(TablePipeline, method)) == _parameters(getattr(Pipeline, method))


def screen_text(app) -> str:
    """What the terminal shows right now, as plain text (for assertions on layout)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(
        app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    )
    return console.export_text(styles=False)


def widget_text(widget, width: int = 200) -> str:
    """The plain text a Static-like widget was last given (whatever its scroll position)."""
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True, legacy_windows=False)
    console.print(widget.content)
    return console.export_text(styles=False)


# -- driving the app under Pilot --------------------------------------------------------


async def until(pilot, predicate, timeout: float = 10.0) -> None:
    """Let the app run until `predicate()` holds (workers post from other threads)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate.__doc__ or predicate}")
        await pilot.pause(0.02)


def turns(app) -> list[TurnView]:
    """The app's turn views, oldest first."""
    return app.turn_views


def done(app, count: int = 1):
    def check() -> bool:
        """turns answered and judged"""
        views = turns(app)
        return len(views) >= count and all(v.phase in ("done", "failed") for v in views[:count])

    return check


async def paste_and_send(app, pilot, text: str) -> None:
    app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")


async def ask(app, pilot, text: str) -> TurnView:
    count = len(turns(app))
    await paste_and_send(app, pilot, text)
    await until(pilot, done(app, count + 1))
    return turns(app)[count]


async def run_command(app, pilot, words: str) -> None:
    await pilot.press("ctrl+p")
    await pilot.pause()
    await pilot.press(*words)
    await pilot.pause(0.3)
    await pilot.press("enter")
    await pilot.pause()
