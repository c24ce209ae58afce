"""The one flow: question -> clean -> retrieve -> probes -> verdicts -> answer.

Every front end (`ask`, `ask --batch`, `doctor`, `run`, the chat) calls this
module and only presents what it returns:

    pipeline = Pipeline(engine=Engine(), runner=ProbeRunner())
    result = pipeline.ask("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device")
    result = pipeline.doctor()

`ask` reports progress through callbacks (the ranked causes before any
probe has finished, then every probe's start and end) and stops early when
`cancel` is set. It returns a new Result each time; nothing it was given is
changed.

The probe launch starts as soon as the question is known, in parallel with
retrieval: one torchrun launch runs every probe at about the cost of a bare
launch, so asking with probes costs about one launch, not retrieval plus a
launch. Probes that need launches of their own (set_device_order's variants
on a GPU machine) run afterwards, only when a ranked cause links them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from assistant.errors import UserError
from assistant.results import CauseResult, Finding, ProbeRun, Result, RootError, Verdict

OnCauses = Callable[[Result], None]
OnProbe = Callable[[object], None]  # receives assistant.probing.runner.ProgressEvent


class Retrieval(Protocol):
    """What the flow needs of the knowledge side (assistant.knowledge.engine.Engine)."""

    def ask(self, query: str, top: int = 5, context: str | None = None) -> Result: ...

    def signatures(self) -> dict[str, list[str]]: ...

    def cause(self, cause_id: str) -> dict: ...


class AnswerLog(Protocol):
    """Where answers are kept for `assistant feedback` (assistant.feedback.FeedbackStore)."""

    def remember(self, query: str, cause_ids: list[str], after: str | None = None) -> str: ...


class Probing(Protocol):
    """What the flow needs of the probing side (assistant.probing.runner.ProbeRunner)."""

    def run(self, names, on_progress=None, cancel=None) -> list[ProbeRun]: ...


@dataclass
class Observer:
    """Progress callbacks of one call; each is optional and runs in the caller's worker."""

    on_causes: OnCauses | None = None
    on_probe: OnProbe | None = None

    def causes(self, result: Result) -> None:
        if self.on_causes is not None:
            self.on_causes(result)

    def probe(self, event) -> None:
        if self.on_probe is not None:
            self.on_probe(event)


@dataclass
class Question:
    """One question and what the caller already knows about it.

    findings: static findings in the user's script (assistant lint).
    script_checked: the user's script was linted for this question (its
        findings, none when it is clean, are in `findings`): the answer does
        not ask for the script again.
    root_error: the root error when the caller knows it better than the
        text does (`assistant run` reads it from the ranks' own records).
    context: an earlier question of the same conversation (a follow-up).
    earlier: the causes of the earlier answer that asked for this reply (what
        would decide between them): the reply adds to that report, it does not
        replace it (with_earlier_answer).
    previous: the causes of the conversation's latest answer when it asked
        nothing (it was sure): a reply without an error of its own (a config,
        nvidia-smi, "it still hangs") adds to that report the same way; one
        with its own root error is a new failure, ranked on its own.
    known_runs: probe runs from earlier in the session, reused as they are.
    after: the kept answer this question replies to (`ask --after`), kept
        with the answer so a reply to it is read with the whole thread.
    """

    text: str
    top: int = 5
    findings: Sequence[Finding] = ()
    script_checked: bool = False
    root_error: RootError | None = None
    context: str | None = None
    earlier: Sequence[CauseResult] = ()
    previous: Sequence[CauseResult] = ()
    known_runs: Sequence[ProbeRun] = ()
    probe: bool = True
    after: str | None = None


# How much a reply to "what would decide?" weighs against the answer that asked
# for it: the first report stays the main evidence (see with_earlier_answer).
REPLY_WEIGHT = 0.25
# A reply that shows an error of its own (a traceback, an NCCL line) is evidence
# the first report lacked: it weighs as it did before replies were weighed down.
ROOT_REPLY_WEIGHT = 0.5
REPLY_POOL = 50  # causes the reply is ranked over before the merge (the engine's most)


def with_conversation(reply: Result, question: Question) -> Result:
    """The reply's ranking with the conversation's answer it adds to, if any.

    `earlier` (the answer asked for this reply) always; `previous` (a sure
    answer) only when the reply shows no error of its own, else the reply is
    a new failure and stands alone, cut to the `top` it asked for.
    """
    if question.earlier:
        return with_earlier_answer(reply, question.earlier, question.top)
    if question.previous and reply.root_error is None:
        return with_earlier_answer(reply, question.previous, question.top)
    if question.previous:
        return replace(reply, causes=reply.causes[: question.top])
    return reply


def with_earlier_answer(reply: Result, earlier: Sequence[CauseResult], top: int) -> Result:
    """The reply's ranking merged with the earlier answer's, cause by cause.

    A reply to "what would decide?" is often a line ("24G each", "it works on
    one GPU", a config dump): ranked alone, with only the earlier question's
    words as context, it lost what the first report's signatures and labelled
    look-alikes had found. On 65 real reports whose reporter posted more later
    in the thread (`kb eval`, "two turns"), the first answers put the right
    cause first for 27, the replies ranked so for 23; scoring each cause
    (earlier + REPLY_WEIGHT x reply) / (1 + REPLY_WEIGHT) gave 27 again and
    kept the replies that decided (a traceback, an NCCL log; data/eval/README.md,
    "Session 13"); the plain mean gave 26. Measured again on 98 (session 32):
    first answers 54 first; REPLY_WEIGHT 0.5 gave 52 (3 fixed, 5 lost), 0.25
    gave 55 (the same 3 fixed, 2 lost; recall@3 69 -> 68), 0.15 55 too: a
    reply is mostly a thin line, and weighed half it undid first answers. A
    reply with a root error of its own keeps ROOT_REPLY_WEIGHT: it decides.
    A reply whose first cause is an exact KB signature of that root error stands
    alone (reply_decides): merged, an earlier guess from vague words could still
    narrow its lead until a traceback that names the failure read "medium". On the
    116 labelled reports with a followup (session 38) no second answer moved.

    `reply` should hold every cause the reply ranks (a cause it did not rank
    counts 0). A cause kept from the earlier answer is judged afresh (its
    verdict reset). The best `top` are kept.
    """
    if reply_decides(reply):
        return replace(reply, causes=reply.causes[:top])
    mine = {cause.id: cause for cause in reply.causes}
    theirs = {cause.id: cause for cause in earlier}
    weight = REPLY_WEIGHT if reply.root_error is None else ROOT_REPLY_WEIGHT
    merged = []
    for cause_id in dict.fromkeys([*mine, *theirs]):
        own, old = mine.get(cause_id), theirs.get(cause_id)
        total = (old.score if old else 0.0) + weight * (own.score if own else 0.0)
        base = own if own is not None else replace(old, verdict=Verdict("not_run"))
        merged.append(replace(base, score=total / (1 + weight)))
    merged.sort(key=lambda cause: -cause.score)  # stable: the reply's order breaks ties
    return replace(reply, causes=merged[:top])


def reply_decides(reply: Result) -> bool:
    """The reply's own root error is matched exactly by the cause it ranks first
    (a KB signature in the error line itself): that error is the failure, and the
    earlier answer's guesses from vaguer words no longer weigh against it."""
    from assistant.confidence import names_the_root_error

    return bool(reply.causes) and names_the_root_error(reply.causes[0])


def with_pasted_findings(question: Question) -> Question:
    """The question with the findings of the code and launch lines pasted into
    it (lint.pasted) added.

    A person who quotes `wait_for_everyone()` inside `if is_main_process:`,
    or `CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2`, has shown the
    cause; the words around it ("it hangs at checkpoint") say little. Only
    checks that hold on a fragment run there.
    """
    from assistant.lint.pasted import lint_pasted

    pasted = lint_pasted(question.text)
    if not pasted:
        return question
    return replace(question, findings=[*question.findings, *pasted])


@dataclass
class Pipeline:
    """The whole flow, with the knowledge side and the probing side passed in.

    engine: answers retrieval (None for machine-only use: doctor).
    runner: runs probes (None: retrieval only, every verdict stays not_run).
    answers: keeps each answer under an answer_id for `assistant feedback` (None: no id).
    """

    engine: Retrieval | None = None
    runner: Probing | None = None
    answers: AnswerLog | None = None
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="assistant-probes"),
        repr=False,
    )

    # -- the question flow ------------------------------------------------------

    def ask(
        self,
        question: Question | str,
        observer: Observer | None = None,
        cancel: threading.Event | None = None,
    ) -> Result:
        """Rank the causes of a question, probe this machine, judge, re-rank."""
        question = Question(question) if isinstance(question, str) else question
        observer = observer or Observer()
        if not question.text or not question.text.strip():
            raise UserError("the question is empty: paste an error message or a log")
        if self.engine is None:
            raise UserError("no knowledge base loaded")
        question = with_pasted_findings(question)
        cancel = cancel or threading.Event()
        early = self._start_probes(question, observer, cancel)
        # A reply merged with an earlier answer needs every cause's reply score.
        top = REPLY_POOL if question.earlier or question.previous else question.top
        try:
            ranked = self.engine.ask(question.text, top=top, context=question.context)
        except BaseException:
            cancel.set()  # a failed retrieval must not leave a launch running
            raise
        if question.root_error is not None:
            ranked = replace(ranked, root_error=question.root_error)
        ranked = with_conversation(ranked, question)
        ranked = self._with_finding_causes(ranked, question.findings)
        observer.causes(ranked)
        if self._probing(question):
            runs = self._finish_probes(ranked, question, early, observer, cancel)
        else:
            runs = list(question.known_runs)
        judged = self.judge(ranked, runs, question.findings, question.script_checked)
        return self._keep(judged, question.after)

    def _with_finding_causes(self, ranked: Result, findings: Sequence[Finding]) -> Result:
        """Every cause a finding names joins the answer, even if the text did not rank it.

        Retrieval ranks causes from the words; a script finding (lint) or what
        `assistant run` saw in the job proves a cause the words may not name.
        Such a cause joins with the best score, to be judged like the others;
        beside a root error the words explain with other causes, with the
        lowest score instead (a true finding about the script, not this error's
        explanation: verdicts.apply.explains_failure).
        """
        present = {cause.id for cause in ranked.causes}
        missing = [f.cause_id for f in findings if f.cause_id not in present]
        if not missing:
            return ranked
        from assistant.results import CauseResult

        scores = [cause.score for cause in ranked.causes]
        joining = min(scores) if ranked.root_error and scores else max(scores, default=1.0)
        added = []
        for cause_id in dict.fromkeys(missing):
            try:
                added.append(CauseResult.from_kb(self.engine.cause(cause_id), joining))
            except UserError:
                continue  # an id this KB does not have (a team KB without it)
        return replace(ranked, causes=list(ranked.causes) + added)

    def _keep(self, result: Result, after: str | None = None) -> Result:
        """The final answer, with the handle users give `assistant feedback`."""
        if self.answers is None or result.query is None:
            return result
        causes = [cause.id for cause in result.causes]
        handle = self.answers.remember(result.query, causes, after)
        return replace(result, answer_id=handle)

    def judge(
        self,
        result: Result,
        runs: Sequence[ProbeRun],
        findings: Sequence[Finding] = (),
        script_checked: bool = False,
    ) -> Result:
        """Verdicts for a ranked result: a new Result, re-ranked (confirmed first).

        script_checked: see Question.
        """
        from assistant.confidence import assess
        from assistant.verdicts import apply_verdicts

        signatures = self.engine.signatures() if self.engine is not None else None
        judged = apply_verdicts(result, list(runs), list(findings), signatures)
        return assess(judged, script_checked)

    # -- machine only -------------------------------------------------------------

    def doctor(
        self,
        lang: str = "en",
        observer: Observer | None = None,
        cancel: threading.Event | None = None,
    ) -> Result:
        """Probe this machine and judge every contract cause, with no question; with
        a nodes check (`doctor --nnodes`), also the causes only the nodes decide
        (a checkpoint folder on each node's own disk)."""
        from assistant.knowledge.catalog import contract_causes, kb_signatures
        from assistant.probing.registry import probe_names
        from assistant.verdicts import apply_verdicts

        if self.runner is None:
            raise UserError("doctor needs the probe runner")
        observer = observer or Observer()
        from assistant.verdicts.nodes import CROSS_NODE_CAUSES, nodes_problem, nodes_report

        runs = self.runner.run(probe_names(), on_progress=observer.probe, cancel=cancel)
        nodes = nodes_report(runs, lang)
        causes = contract_causes(CROSS_NODE_CAUSES if nodes else ())
        blank = Result(query=None, root_error=None, causes=causes, lang=lang)
        judged = apply_verdicts(blank, runs, [], kb_signatures())
        return replace(judged, nodes=nodes, nodes_problem=nodes_problem(runs) or "")

    def run_named(
        self,
        names: Iterable[str],
        observer: Observer | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ProbeRun]:
        """Run the named probes (`assistant probe NAME...`)."""
        if self.runner is None:
            raise UserError("no probe runner")
        observer = observer or Observer()
        return self.runner.run(list(names), on_progress=observer.probe, cancel=cancel)

    # -- probes ---------------------------------------------------------------------

    def _probing(self, question: Question) -> bool:
        return question.probe and self.runner is not None

    def _start_probes(
        self, question: Question, observer: Observer, cancel: threading.Event
    ) -> Future | None:
        """Launch the shared-launch probes now, while retrieval runs."""
        if not self._probing(question):
            return None
        from assistant.probing.registry import probe_names

        # Every probe, not only those the ranked causes will link: one launch
        # runs them all at about the cost of one, and it cannot wait for the ranking.
        known = {run.name for run in question.known_runs}
        names = [name for name in probe_names() if name not in known]
        if not names:
            return None
        return self._pool.submit(self.runner.run, names, on_progress=observer.probe, cancel=cancel)

    def _finish_probes(
        self,
        ranked: Result,
        question: Question,
        early: Future | None,
        observer: Observer,
        cancel: threading.Event,
    ) -> list[ProbeRun]:
        """Every run this answer rests on: known, launched early, and linked extras."""
        from assistant.verdicts import probes_for

        runs = {run.name: run for run in question.known_runs}
        if early is not None:
            runs.update((run.name, run) for run in early.result())
        extra = [name for name in probes_for(ranked.causes) if name not in runs]
        if extra and not cancel.is_set():
            fresh = self.runner.run(extra, on_progress=observer.probe, cancel=cancel)
            runs.update((run.name, run) for run in fresh)
        return list(runs.values())

    def close(self) -> None:
        """Stop accepting probe launches (running ones finish or are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
