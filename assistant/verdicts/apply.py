"""Applying verdicts to a result, and choosing the probes to run for it."""

from __future__ import annotations

from assistant.probing.registry import PROBES
from assistant.results import VERDICT_RANK, CauseResult, Finding, ProbeRun, Result
from assistant.verdicts.devices import advice_outcomes
from assistant.verdicts.inputs import judge

# --- applying verdicts to a result -----------------------------------------------------


def apply_verdicts(result: Result, runs: list[ProbeRun], findings: list[Finding]) -> Result:
    """Judge every cause of a result, mark the advice this machine settles, re-rank.

    Answers whose advice the probes refute get stance "refuted_here", those
    whose advice works where another fails "confirmed_here". Causes are then
    sorted stably by VERDICT_RANK (confirmed first, ruled_out last).
    """
    by_name = {run.name: run for run in runs}
    refuted, confirmed = advice_outcomes(by_name)
    for cause in result.causes:
        cause.verdict = judge(cause.id, by_name, result.root_error, findings, result.lang)
        refuted |= set(cause.verdict.refutes)
    for cause in result.causes:
        for answer in cause.answers:
            if answer.advice and answer.advice in refuted:
                answer.stance = "refuted_here"
            elif answer.advice and answer.advice in confirmed:
                answer.stance = "confirmed_here"
    best = max((c.score for c in result.causes), default=0.0)
    result.causes = sorted(result.causes, key=lambda c: _rerank_group(c, best))
    result.probes = list(runs)
    return result


# A confirmed cause rises only when retrieval also found it relevant: a fact
# true of this machine (no GPU here, say) must not push aside the cause the
# error text points to.
RISE_FLOOR = 0.5


def _rerank_group(cause: CauseResult, best_score: float) -> int:
    group = VERDICT_RANK.get(cause.verdict.verdict, 1)
    if cause.verdict.verdict == "confirmed" and cause.score < RISE_FLOOR * best_score:
        return VERDICT_RANK["inconclusive"]
    return group


def probes_for(causes: list[CauseResult], limit: int | None = None) -> list[str]:
    """The registered probes linked to the first `limit` causes (all by default).

    Deduplicated, in the order the causes and their probe lists give them.
    """
    chosen = causes if limit is None else causes[:limit]
    names = [name for cause in chosen for name in cause.probes if name in PROBES]
    return list(dict.fromkeys(names))
