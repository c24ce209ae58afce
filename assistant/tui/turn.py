"""One conversation turn on screen: the question, its root error, causes, probes, findings.

A turn renders in one language, its own (the language its answer was made
in), whatever the interface language is now: a Chinese chat reopened in
the English interface must not show Chinese evidence under English titles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ListItem, ListView, Static

from assistant.chat.conversation import JobRecord, Turn
from assistant.i18n import cause_summary, cause_title, decide_question, source_and_evidence, t
from assistant.results import CauseResult, Finding, ProbeRun, Result
from assistant.tui.keys import LocalizedBindings, bilingual
from assistant.tui.messages import (
    CauseChosen,
    CauseFeedback,
    CopyFix,
    FeedbackGiven,
    Notice,
    TypedElsewhere,
)
from assistant.tui.present import (
    PROBE_MARKS,
    VERDICT_MARKS,
    OutputTail,
    middle_cut,
    query_preview,
    seconds,
    verdict_counts,
)
from assistant.tui.strings import tr

ROOT_ERROR_CHARS = 160  # about two lines at 80 columns; the export has it all


@dataclass
class ProbeRow:
    """How one probe of a turn is doing."""

    name: str
    state: str = "waiting"  # waiting | running | done
    started: float = 0.0  # app clock when it started
    started_at_run: float = 0.0  # runner's elapsed-since-run-start when it started
    elapsed: float = 0.0
    status: str = ""
    reused: bool = False


@dataclass
class JobState:
    """A watched launch of a run turn: its output's tail, its ranks, how it ended."""

    started: float  # app clock when it started
    output: OutputTail = field(default_factory=OutputTail)
    ranks: list[str] = field(default_factory=list)  # one line per rank, once it ended
    seconds: float | None = None  # how long it ran, once it ended
    note: str = ""  # how it ended when there is no answer (exit 0, stopped)
    succeeded: bool = False

    def record(self) -> JobRecord:
        """What the history keeps of it (bounded there)."""
        output = self.output.shown()
        return JobRecord.kept(output, self.ranks, self.seconds, self.note, self.succeeded)

    @classmethod
    def restored(cls, record: JobRecord) -> JobState:
        """The job of a turn loaded from the history, as it ended."""
        output = OutputTail()
        output.lines = list(record.output)
        return cls(0.0, output, list(record.ranks), record.seconds, record.note, record.succeeded)


class CauseItem(ListItem):
    """One candidate cause: rank, verdict mark, title, verdict and its source, first evidence."""

    def __init__(self, number: int, cause: CauseResult, lang: str, findings: list[Finding]):
        super().__init__(classes=f"cause verdict-{cause.verdict.verdict}")
        self.number = number
        self.cause = cause
        self.lang = lang
        self.findings = findings

    def compose(self) -> ComposeResult:
        with Horizontal(classes="cause-head"):
            yield Label(classes="cause-title")
            yield Label(classes="cause-verdict")
        yield Label(classes="cause-detail")

    def on_mount(self) -> None:
        cause, lang = self.cause, self.lang
        verdict = cause.verdict.verdict
        mark = VERDICT_MARKS.get(verdict, "·")
        self.query_one(".cause-title", Label).update(
            Text(f"{self.number}. {mark} {cause_title(cause, lang)}")
        )
        # Doctor results are not ranked by a query: no score to show.
        score = f"  {cause.score:.2f}" if cause.score > 0 else ""
        word = t(f"verdict_word.{verdict}", lang)
        self.query_one(".cause-verdict", Label).update(Text(word + score))
        # Where the verdict comes from leads its evidence: only a probe's
        # verdict says "tested on this machine".
        detail = source_and_evidence(cause, lang, self.findings) or cause_summary(cause, lang)
        self.query_one(".cause-detail", Label).update(Text(detail))


class CauseList(LocalizedBindings, ListView):
    """The causes of one turn, best first; Enter opens one, c copies its fix.

    f / w say "this cause fixed it" / "wrong cause", pressed twice (a word
    typed into the list must not leave feedback), and only on an answer that
    was kept (`answer_id`); otherwise the keys are free.
    Printable keys that are not bound here go to the input: a person who
    starts typing a follow-up while the list has focus loses nothing.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("enter", "select_cursor", "key.open", "causes.open"),
        *bilingual("c", "copy_fix", "key.copy_fix", "causes.copy_fix"),
        *bilingual("f", "feedback('fixed')", "key.fixed", "causes.fixed"),
        *bilingual("w", "feedback('wrong')", "key.wrong", "causes.wrong"),
        *bilingual("escape", "app.focus_input", "key.input", "causes.input", show=False),
    ]

    answer_id = ""  # set by the turn: the kept answer these causes belong to
    armed: tuple[str, str] | None = None  # (cause id, verdict) pressed once

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "in_lang" and str(parameters[1]).startswith("feedback") and not self.answer_id:
            return False  # nothing kept to give feedback on: f and w type into the input
        return super().check_action(action, parameters)

    @property
    def highlighted_cause(self) -> CauseResult | None:
        item = self.highlighted_child
        return item.cause if isinstance(item, CauseItem) else None

    def action_copy_fix(self) -> None:
        cause = self.highlighted_cause
        if cause is not None:
            self.post_message(CopyFix(cause))

    def action_feedback(self, verdict: str) -> None:
        """f: this cause fixed it; w: this cause is wrong (kept for support teams)."""
        cause = self.highlighted_cause
        if cause is None:
            return
        if self.armed != (cause.id, verdict):
            self.armed = (cause.id, verdict)
            lang = getattr(self.app, "lang", "en")
            self.post_message(Notice(tr(f"feedback.confirm_{verdict}", lang, cause=cause.id)))
            return
        self.armed = None
        self.post_message(CauseFeedback(cause, verdict))

    def on_key(self, event: events.Key) -> None:
        if event.key not in ("f", "w"):
            self.armed = None  # the second press must follow the first
        if event.is_printable and event.character and event.key not in self.app.active_bindings:
            event.stop()
            event.prevent_default()
            self.post_message(TypedElsewhere(event.character))


class TurnView(Vertical):
    """One turn: the question, its root error, causes, probes and findings."""

    def __init__(self, key: int, turn: Turn, clock: Callable[[], float]):
        super().__init__(id=f"turn-{key}", classes="turn")
        self.key = key  # unique for the app's lifetime; messages name turns by it
        self.turn = turn
        self.clock = clock
        # waiting_model | job | searching | linting | probing | done | failed
        self.phase = "searching"
        self.preview = query_preview(turn.query)  # once: the query may be a 10 MB log
        self.error = ""
        self.probe_rows: dict[str, ProbeRow] = {}
        self.findings: list[Finding] = []  # the conversation's script findings (for "line N")
        self.job: JobState | None = None  # set for a run turn (a watched launch)

    @property
    def lang(self) -> str:
        """The turn's own language (see the module docstring)."""
        return self.turn.lang

    def compose(self) -> ComposeResult:
        # A pasted log is summed up on one line; a typed question may wrap.
        yield Static(classes="turn-query -log" if self.preview[1] else "turn-query")
        yield Static(classes="turn-status")
        yield Static(classes="turn-output")
        yield Static(classes="turn-ranks")
        yield Static(classes="turn-root")
        yield CauseList(classes="turn-causes")
        yield Static(classes="turn-probes")
        yield Static(classes="turn-findings")
        yield Static(classes="turn-decide")

    def on_mount(self) -> None:
        self.refresh_view()

    @property
    def causes(self) -> CauseList:
        return self.query_one(CauseList)

    # -- state set by the app ---------------------------------------------------

    def set_phase(self, phase: str, error: str = "") -> None:
        self.phase, self.error = phase, error
        self.refresh_view()

    async def show_result(self, result: Result, findings: list[Finding] | None = None) -> None:
        """Show (or re-rank) the causes of this turn, keeping the highlighted one."""
        self.turn.result = result
        self.turn.lang = result.lang or self.turn.lang
        if findings is not None:
            self.findings = list(findings)
        if not self.is_attached:
            return  # the app is closing or the conversation was replaced
        causes = self.causes
        # Keep the person's place only if they are in the list; otherwise the
        # top (now the best-confirmed) cause is the one to look at.
        keep = (
            causes.highlighted_cause.id if causes.has_focus and causes.highlighted_cause else None
        )
        await causes.clear()
        causes.answer_id, causes.armed = result.answer_id, None
        items = [CauseItem(n, c, self.lang, self.findings) for n, c in enumerate(result.causes, 1)]
        await causes.extend(items)
        ids = [c.id for c in result.causes]
        if items:
            causes.index = ids.index(keep) if keep in ids else 0
        self.refresh_view()

    def show_reused(self, reused: dict[str, ProbeRun]) -> None:
        """Probe runs from earlier in the conversation that this turn reuses."""
        for name, run in reused.items():
            self.probe_rows[name] = ProbeRow(
                name, "done", elapsed=run.seconds, status=run.status, reused=True
            )
        self.refresh_view()

    def start_job(self) -> None:
        """This turn watches a launch: its output streams in until it ends."""
        self.job = JobState(started=self.clock())
        self.set_phase("job")

    def job_output(self, data: bytes) -> None:
        if self.job is not None:
            self.job.output.feed(data)
            self.refresh_view()

    def job_ended(self, ranks: list[str], seconds: float, diagnosing: bool) -> None:
        """The launch ended; `diagnosing`: it failed or hung and its answer is coming."""
        if self.job is not None:
            self.job.ranks, self.job.seconds = ranks, seconds
            self.turn.job = self.job.record()
        self.set_phase("searching" if diagnosing else self.phase)

    def job_note(self, note: str, succeeded: bool) -> None:
        """How a launch with no answer ended (it succeeded, or it was stopped)."""
        if self.job is not None:
            self.job.note, self.job.succeeded = note, succeeded
            self.turn.job = self.job.record()
        self.set_phase("done")

    def probe_event(self, probe: str, state: str, elapsed: float, status: str | None) -> None:
        """A runner progress event; `elapsed` counts from the start of the run."""
        if self.job is not None and self.phase == "searching":
            self.phase = "probing"  # a run's diagnosis reports no ranking before its probes
        row = self.probe_rows.setdefault(probe, ProbeRow(probe))
        if state == "started":
            row.state, row.started, row.started_at_run = "running", self.clock(), elapsed
        else:
            took = max(elapsed - row.started_at_run, 0.0)
            row.state, row.elapsed, row.status = "done", took, status or "ok"
        self.refresh_view()

    def probe_finished(self, run: ProbeRun) -> None:
        """The final outcome of a probe, with its own duration."""
        row = self.probe_rows.setdefault(run.name, ProbeRow(run.name))
        if not row.reused:
            row.state, row.elapsed, row.status = "done", run.seconds, run.status
        self.refresh_view()

    def finish_rows(self, status: str) -> None:
        """Close the rows of probes that never reported back (stopped, or the run failed)."""
        for row in self.probe_rows.values():
            if row.state != "done":
                took = self.clock() - row.started if row.state == "running" else 0.0
                row.state, row.status, row.elapsed = "done", status, max(took, 0.0)
        self.refresh_view()

    async def restore(self, findings: list[Finding]) -> None:
        """Show a turn loaded from the history as it ended."""
        turn = self.turn
        if turn.job is not None:
            self.job = JobState.restored(turn.job)
        if turn.result is not None:
            await self.show_result(turn.result, findings)
            for run in turn.result.probes:
                self.probe_rows[run.name] = ProbeRow(
                    run.name, "done", elapsed=run.seconds, status=run.status
                )
        if turn.error and turn.result is None:
            self.set_phase("failed", turn.error)
        else:
            self.set_phase("done")

    @property
    def running(self) -> bool:
        """Something with an elapsed time is running (a probe, a watched job)."""
        return self.phase == "job" or any(
            row.state == "running" for row in self.probe_rows.values()
        )

    @property
    def decide_text(self) -> str:
        """The one follow-up question when the answer is not sure ('' otherwise)."""
        result = self.turn.result
        if self.phase != "done" or result is None or self.turn.kind != "ask":
            return ""
        if result.confidence in (None, "high"):
            return ""
        return decide_question(result.decide, self.lang)

    # -- rendering ----------------------------------------------------------------

    def refresh_view(self) -> None:
        if not self.is_mounted:
            return
        self.query_one(".turn-query", Static).update(self._query_text())
        self.query_one(".turn-status", Static).update(self._status_text())
        self._refresh_job()
        root = self.turn.root_error
        root_widget = self.query_one(".turn-root", Static)
        root_widget.display = root is not None
        if root is not None:
            where = f" (rank {root.rank})" if root.rank is not None else ""
            line = Text(t("root_error", self.lang) + where + "  ", style="bold")
            message = middle_cut(root.message, ROOT_ERROR_CHARS)
            line.append(f"{root.type}: {message}", style="red")
            root_widget.update(line)
        self.causes.display = bool(self.turn.result and self.turn.result.causes)
        probes = self.query_one(".turn-probes", Static)
        probes.display = bool(self.probe_rows)
        if self.probe_rows:
            probes.update(self._probe_text())
        findings = self.query_one(".turn-findings", Static)
        findings.display = self.turn.kind == "lint" and self.phase == "done"
        if findings.display:
            findings.update(self._findings_text(self.turn.findings))
        decide = self.query_one(".turn-decide", Static)
        question = self.decide_text
        decide.display = bool(question)
        if question:
            decide.update(Text("? " + question, style="bold"))

    def _refresh_job(self) -> None:
        """The watched job's output tail and, once it ended, its ranks."""
        job = self.job
        output = self.query_one(".turn-output", Static)
        ranks = self.query_one(".turn-ranks", Static)
        output.display = job is not None and bool(job.output.shown())
        ranks.display = job is not None and bool(job.ranks)
        if job is None:
            return
        if output.display:
            output.update(Text("\n".join(job.output.shown()), style="dim"))
        if ranks.display:
            ranks.update(Text("\n".join(job.ranks)))

    def _query_text(self) -> Text:
        turn, lang = self.turn, self.lang
        if turn.kind == "doctor":
            return Text("› " + tr("turn.doctor", lang), style="bold")
        if turn.kind == "lint":
            return Text("› " + tr("turn.lint", lang, path=turn.query), style="bold")
        head, more = self.preview
        line = Text("› ", style="bold")
        if more:
            line.append(tr("turn.lines", lang, count=f"{more + 1:,}") + " ", style="dim")
        line.append(head, style="bold")
        return line

    def _status_text(self) -> Text:
        lang = self.lang
        if self.phase == "failed":
            return Text(tr("turn.error", lang, error=self.error), style="red")
        if self.phase == "job" and self.job is not None:
            took = seconds(max(self.clock() - self.job.started, 0.0))
            return Text(tr("run.running", lang, seconds=took), style="yellow")
        if self.phase in ("waiting_model", "searching", "linting"):
            return Text(tr(f"turn.{self.phase}", lang), style="yellow")
        result = self.turn.result
        if self.phase == "probing":
            # The pipeline launches every probe at once; rows appear as they
            # start, so only what has started is counted (no made-up total).
            rows = self.probe_rows.values()
            done = sum(row.state == "done" for row in rows)
            running = sum(row.state == "running" for row in rows)
            text = Text(tr("turn.probing", lang, done=done, running=running), style="yellow")
        elif result is not None and self.turn.kind != "lint":
            text = Text(tr("turn.done", lang, **verdict_counts(result.causes)), style="green")
            if result.confidence and self.turn.kind == "ask":
                text.append("  " + t(f"confidence.{result.confidence}", lang), style="bold")
            if not self.probe_rows and self.turn.kind == "ask" and not self.error:
                text.append("  " + tr("turn.no_probes", lang), style="dim")
        elif self.job is not None and self.job.note:
            text = Text(self.job.note, style="green" if self.job.succeeded else "yellow")
        else:
            text = Text()
        if self.error:
            text.append(("  " if text.plain else "") + self.error, style="red")
        if result is not None and result.causes and self.turn.kind != "lint":
            text.append((" · " if text.plain else "") + tr("turn.open_hint", lang), style="dim")
        return text

    def _probe_text(self) -> Text:
        lang = self.lang
        text = Text(tr("probe.label", lang) + "  ", style="bold")
        for number, row in enumerate(self.probe_rows.values()):
            if number:
                text.append("  ·  ", style="dim")
            if row.state == "waiting":
                text.append(f"… {row.name} {tr('probe.waiting', lang)}", style="dim")
            elif row.state == "running":
                took = seconds(max(self.clock() - row.started, 0.0))
                text.append(f"⟳ {row.name} {tr('probe.running', lang, seconds=took)}", "yellow")
            else:
                mark = PROBE_MARKS.get(row.status, "?")
                style = "green" if row.status in ("ok", "not_applicable") else "red"
                label = tr(f"probe.status.{row.status}", lang)
                note = f" ({tr('probe.reused', lang)})" if row.reused else ""
                text.append(f"{mark} {row.name} {label} {seconds(row.elapsed)}{note}", style)
        return text

    def _findings_text(self, findings: list[Finding]) -> Text:
        lang, path = self.lang, self.turn.query
        if not findings:
            return Text(tr("lint.none", lang, path=path), style="green")
        text = Text(tr("lint.found", lang, count=len(findings), path=path), style="bold")
        for finding in findings:
            text.append(f"\n  line {finding.line}  ", style="dim")
            text.append(finding.cause_id, style="cyan")
            text.append(f"  {finding.message}")
        return text

    # -- messages up ----------------------------------------------------------------

    def on_cause_feedback(self, message: CauseFeedback) -> None:
        # The list knows the cause; this turn knows the answer it belongs to.
        message.stop()
        handle = self.turn.result.answer_id if self.turn.result else ""
        self.post_message(FeedbackGiven(handle, message.cause.id, message.verdict))

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, CauseItem):
            self.post_message(CauseChosen(self.key, event.item.cause))
