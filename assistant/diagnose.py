"""Machine-only diagnosis: `assistant doctor` and `assistant probe NAME...`.

doctor() runs every registered probe in as few launches as possible and
judges every contract cause against the facts, with no query: confirmed
causes first. The KB is read only for titles, fixes and the community
advice the probes can settle; when it cannot be loaded (being edited, or
pydantic missing on a bare GPU node) the cause ids stand in for titles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from assistant.config import contract_ids, kb_layers
from assistant.probing.registry import probe_names
from assistant.results import AnswerRef, CauseResult, ProbeRun, Result
from assistant.probing.runner import ProbeRunner, ProgressEvent
from assistant.verdicts import apply_verdicts


def doctor(
    runner: ProbeRunner,
    lang: str = "en",
    on_progress: Callable[[ProgressEvent], None] | None = None,
    cancel: threading.Event | None = None,
) -> Result:
    """Probe this machine and judge every contract cause, confirmed first."""
    runs = runner.run(probe_names(), on_progress=on_progress, cancel=cancel)
    result = Result(query=None, root_error=None, causes=contract_causes(), probes=runs, lang=lang)
    return apply_verdicts(result, runs, [])


def run_named(
    runner: ProbeRunner,
    names: list[str],
    on_progress: Callable[[ProgressEvent], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[ProbeRun]:
    """Run the named probes (`assistant probe NAME...`); ValueError for an unknown name."""
    return runner.run(list(names), on_progress=on_progress, cancel=cancel)


def contract_causes() -> list[CauseResult]:
    """One CauseResult per contract cause, described from the KB where it loads."""
    ids = contract_ids()
    knowledge = _load_kb_quietly()
    if knowledge is None:
        return [CauseResult(id=cause_id, title=cause_id, score=0.0) for cause_id in ids]
    answers = _advice_answers(knowledge)
    causes = []
    for cause_id in ids:
        cause = knowledge.causes.get(cause_id)
        if cause is None:
            causes.append(CauseResult(id=cause_id, title=cause_id, score=0.0))
            continue
        causes.append(CauseResult.from_kb(cause.model_dump(), 0.0, answers.get(cause_id, [])))
    return causes


def _load_kb_quietly():
    """The KB, or None when it cannot be loaded right now."""
    try:
        from assistant.knowledge.kb import load_kb

        return load_kb(kb_layers(), require_contract=False)
    # KBError while the KB is being edited, ImportError without pydantic: titles fall back to ids.
    except Exception:  # noqa: BLE001
        return None


def _advice_answers(knowledge) -> dict[str, list[AnswerRef]]:
    """Community answers carrying an advice tag, under each cause they claim.

    Only these can be settled by a probe, which is what doctor reports on.
    """
    answers: dict[str, list[AnswerRef]] = {}
    for thread in knowledge.threads:
        for answer in thread.answers:
            if not answer.advice:
                continue
            for cause_id in answer.claims:
                answers.setdefault(cause_id, []).append(
                    AnswerRef.from_kb(answer.model_dump(), thread.id)
                )
    return answers
