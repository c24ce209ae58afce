"""The KB as a catalogue of causes, for flows with no question (`doctor`).

doctor judges every contract cause against the probe facts. The KB is read
only for titles, fixes, signatures and the community advice the probes can
settle; when it cannot be loaded (being edited, or pydantic missing on a bare
GPU node) the cause ids stand in for titles and no signature is known.
"""

from __future__ import annotations

from functools import lru_cache

from assistant.config import contract_ids, kb_layers
from assistant.results import AnswerRef, CauseResult


def contract_causes() -> list[CauseResult]:
    """One CauseResult per contract cause, described from the KB where it loads."""
    knowledge = load_quietly()
    if knowledge is None:
        return [CauseResult(id=cause_id, title=cause_id, score=0.0) for cause_id in contract_ids()]
    answers = advice_answers(knowledge)
    causes = []
    for cause_id in contract_ids():
        cause = knowledge.causes.get(cause_id)
        if cause is None:
            causes.append(CauseResult(id=cause_id, title=cause_id, score=0.0))
            continue
        causes.append(CauseResult.from_kb(cause.model_dump(), 0.0, answers.get(cause_id, [])))
    return causes


def kb_signatures() -> dict[str, list[str]]:
    """Every cause's signatures from the KB files (empty when the KB cannot load)."""
    knowledge = load_quietly()
    if knowledge is None:
        return {}
    return {cause_id: list(cause.signatures) for cause_id, cause in knowledge.causes.items()}


def load_quietly():
    """The KB (all its layers), or None when it cannot be loaded right now."""
    return _load_layers(tuple(kb_layers()))


@lru_cache(maxsize=4)
def _load_layers(layers: tuple):
    """Read once per process and set of layers (`--kb` may change them)."""
    try:
        from assistant.knowledge.kb import load_kb

        return load_kb(list(layers), require_contract=False)
    # KBError while the KB is being edited, ImportError without pydantic: titles fall back to ids.
    except Exception:  # noqa: BLE001
        return None


def advice_answers(knowledge) -> dict[str, list[AnswerRef]]:
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
                    AnswerRef.from_kb(answer.model_dump(), thread.id, thread.question)
                )
    return answers
