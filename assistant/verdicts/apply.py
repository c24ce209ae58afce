"""Applying verdicts to a result, and choosing the probes to run for it."""

from __future__ import annotations

from dataclasses import replace

from assistant.probing.registry import PROBES
from assistant.results import VERDICT_RANK, AnswerRef, CauseResult, Finding, ProbeRun, Result
from assistant.verdicts.devices import advice_outcomes
from assistant.verdicts.inputs import judge
from assistant.verdicts.signatures import Signatures, as_refined, kb_refinements, kb_signatures

# --- the reading order -------------------------------------------------------------------

# Causes are read in the order confirmed, inconclusive, not run, not
# applicable, ruled out, within a score margin: the verdicts reorder causes
# whose retrieval scores (relative to the best) lie within VERDICT_MARGIN of
# each other, a quarter of it per step down that order (confirmed vs ruled
# out: the whole margin). A cause retrieved better by more than that stays
# above, so a fact about this machine ("no GPU here", "/dev/shm is large
# here") never pushes aside the cause the error names. Measured on the
# evaluation sets (data/eval, 149 queries) with this CPU machine's recorded
# probe runs, whose facts are unrelated to those reports: see
# tests/verdicts/test_real_flow.py.
VERDICT_MARGIN = 0.3
# Confirmed by the failing job itself (its error text names the cause, or a
# lint finding in its script) is about this failure, not about the machine:
# such causes lead, whatever their score. A script finding whose cause the
# error's words did not retrieve at all is a true fact about the script but
# not this error's explanation (unused parameters found beside an NCCL system
# error): it is read in its score's place, not first.
JOB_SOURCES = ("error", "script")


def reading_key(
    cause: CauseResult, best_score: float, root_error: bool = False
) -> tuple[int, float]:
    """Sort key of a judged cause: (tier, -(relative score - verdict steps))."""
    relative = cause.score / best_score if best_score > 0 else 1.0
    verdict = cause.verdict
    explains = verdict.verdict == "confirmed" and explains_failure(cause, root_error)
    tier = 0 if explains else 1
    rank = VERDICT_RANK[verdict.verdict]
    if verdict.verdict == "confirmed" and verdict.source == "script" and not explains:
        # A true fact about the script, not this error's explanation: read at its
        # score, without a confirmation's step (with the neighbours signal the
        # leading scores sit closer, and the step alone put such a finding first).
        rank = VERDICT_RANK["not_run"]
    steps = rank / (len(VERDICT_RANK) - 1)
    return tier, -(relative - VERDICT_MARGIN * steps)


def explains_failure(cause: CauseResult, root_error: bool) -> bool:
    """The job's own evidence confirms the cause: its error text, what `assistant
    run` saw, or a script finding for a cause the error's words retrieved (or
    for any cause when there is no root error to explain: a hang, a question)."""
    verdict = cause.verdict
    if verdict.source == "script":
        return bool(cause.signals) or not root_error
    return verdict.source in JOB_SOURCES or verdict.from_job


def reading_order(causes: list[CauseResult], root_error: bool = False) -> list[CauseResult]:
    """Judged causes in the order a person reads them (stable for equal keys)."""
    best = max((c.score for c in causes), default=0.0)
    return sorted(causes, key=lambda c: reading_key(c, best, root_error))


# --- answers under a cause ----------------------------------------------------------------

# Community stance: an answer its thread agreed with first, one it called
# wrong last (and only beside its question, see shown_answers).
STANCE_ORDER = {"right": 0, "partly_right": 0, "unverified": 1, "wrong": 2}
HERE_ORDER = {"confirmed_here": 0, "": 1, "refuted_here": 2}


def shown_answers(
    answers: list[AnswerRef], refuted: set[str], confirmed: set[str]
) -> list[AnswerRef]:
    """Copies of a cause's answers with what this machine showed (`here`), ordered.

    The community `stance` is never changed. An answer its own thread judged
    wrong is shown only with the question it was wrong about, or when this
    machine settled its advice; otherwise a reader would take it for the fix.
    Order: advice confirmed here, then unsettled, then refuted here; within
    each, right and partly right before unverified before wrong.
    """
    marked = [
        replace(a, contradicts=list(a.contradicts), here=_here(a, refuted, confirmed))
        for a in answers
    ]
    shown = [a for a in marked if a.stance != "wrong" or a.question or a.here]
    return sorted(shown, key=lambda a: (HERE_ORDER[a.here], STANCE_ORDER.get(a.stance, 1)))


def _here(answer: AnswerRef, refuted: set[str], confirmed: set[str]) -> str:
    if answer.advice and answer.advice in refuted:
        return "refuted_here"
    if answer.advice and answer.advice in confirmed:
        return "confirmed_here"
    return answer.here


# --- applying verdicts to a result -----------------------------------------------------


def apply_verdicts(
    result: Result,
    runs: list[ProbeRun],
    findings: list[Finding],
    signatures: Signatures | None = None,
) -> Result:
    """A new Result: every cause judged, its answers marked, in reading order.

    Pure: `result` and its causes and answers are left as they were.
    `signatures` (cause id -> regexes, the KB's) decide which causes the
    error text names; None reads them from the KB files when there is an
    error to read. Answers whose advice the probes refute get here =
    "refuted_here", those whose advice works where another fails
    "confirmed_here".
    """
    by_name = {run.name: run for run in runs}
    query = result.query or ""
    if signatures is None:
        signatures = kb_signatures() if (result.root_error or query) else {}
    if signatures and query:
        # A special case the report names reads its general cause's error (kb refines).
        signatures = as_refined(signatures, kb_refinements(), query)
    refuted, confirmed = advice_outcomes(by_name)
    judged = []
    for cause in result.causes:
        verdict = judge(
            cause.id, by_name, result.root_error, findings, result.lang, signatures, query
        )
        refuted |= set(verdict.refutes)
        judged.append((cause, verdict))
    causes = [
        replace(
            cause,
            verdict=verdict,
            probes=list(cause.probes),
            signals=dict(cause.signals),
            answers=shown_answers(cause.answers, refuted, confirmed),
        )
        for cause, verdict in judged
    ]
    return replace(
        result,
        causes=reading_order(causes, root_error=bool(result.root_error)),
        probes=list(runs),
        decide=list(result.decide),
    )


def probes_for(causes: list[CauseResult], limit: int | None = None) -> list[str]:
    """The registered probes linked to the first `limit` causes (all by default).

    Deduplicated, in the order the causes and their probe lists give them.
    """
    chosen = causes if limit is None else causes[:limit]
    names = [name for cause in chosen for name in cause.probes if name in PROBES]
    return list(dict.fromkeys(names))
