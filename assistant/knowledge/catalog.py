"""The KB as a catalogue: its causes for flows with no question (`doctor`), and the
community answers that claim a cause, for every flow that lists them.

doctor judges every contract cause against the probe facts. The KB is read
only for titles, fixes, signatures and the community advice the probes can
settle; when it cannot be loaded (being edited, or pydantic missing on a bare
GPU node) the cause ids stand in for titles and no signature is known.

`claiming_answers` is the one list of a cause's answers: best first under a
ranked cause (`ask`, the chat), in the KB's order in `assistant explain`, and
only those with an advice tag in doctor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Literal

from assistant.config import contract_ids, kb_layers
from assistant.knowledge.textsearch import search_tokens
from assistant.results import AnswerRef, CauseResult

# Best first: answers judged (partly) right lead, unverified follow, wrong ones come
# last; within a group the reader's language, then the finer stance, then the shorter.
STANCE_ORDER = {"right": 0, "partly_right": 1, "unverified": 2, "wrong": 3}
STANCE_GROUP = {"right": 0, "partly_right": 0, "unverified": 1, "wrong": 2}


def contract_causes(extra: tuple[str, ...] = ()) -> list[CauseResult]:
    """One CauseResult per contract cause, then per `extra` KB cause (one a probe of
    this run judges), described from the KB where it loads."""
    ids = [*contract_ids(), *(cause_id for cause_id in extra if cause_id not in contract_ids())]
    knowledge = load_quietly()
    if knowledge is None:
        return [CauseResult(id=cause_id, title=cause_id, score=0.0) for cause_id in ids]
    threads = [thread.model_dump() for thread in knowledge.threads]
    causes = []
    for cause_id in ids:
        cause = knowledge.causes.get(cause_id)
        if cause is None:
            causes.append(CauseResult(id=cause_id, title=cause_id, score=0.0))
            continue
        # Only advice a probe can settle, which is what doctor reports on.
        answers = claiming_answers(threads, cause_id, advice_only=True)
        causes.append(CauseResult.from_kb(cause.model_dump(), 0.0, answers))
    return causes


def kb_signatures() -> dict[str, list[str]]:
    """Every cause's signatures from the KB files (empty when the KB cannot load)."""
    knowledge = load_quietly()
    if knowledge is None:
        return {}
    return {cause_id: list(cause.signatures) for cause_id, cause in knowledge.causes.items()}


def kb_refinements() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per cause that refines others (kb Cause.refines): (the causes it refines,
    its named_by words); empty when the KB cannot load."""
    knowledge = load_quietly()
    if knowledge is None:
        return {}
    return {
        cause_id: (tuple(cause.refines), tuple(cause.named_by))
        for cause_id, cause in knowledge.causes.items()
        if cause.refines and cause.named_by
    }


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


def claiming_answers(
    threads: Iterable[Mapping],
    cause_id: str,
    *,
    order: Literal["kb", "best"] = "kb",
    lang: str = "en",
    advice_only: bool = False,
    limit: int | None = None,
    query: str = "",
) -> list[AnswerRef]:
    """The community answers that claim `cause_id`, from KB threads as dicts (a
    model_dump, or the index's JSON), each with its thread's id and question.

    order "kb": thread by thread, answer by answer, as the KB files give them.
    order "best": the best first for a reader of `lang` who asked `query` (best_first).
    advice_only: only answers with an advice tag, the ones a probe can settle.
    limit: at most this many, after ordering.
    """
    answers = [
        AnswerRef.from_kb(answer, thread["id"], thread.get("question", ""))
        for thread in threads
        for answer in thread["answers"]
        if cause_id in answer["claims"] and (answer.get("advice") or not advice_only)
    ]
    if order == "best":
        answers = best_first(answers, lang, query)
    return answers[:limit]


def best_first(answers: list[AnswerRef], lang: str, query: str = "") -> list[AnswerRef]:
    """Stance first: an answer its own thread judged wrong must not lead because it is
    in the reader's language or close to the question. Then the reader's
    language: an English question answered first by a Chinese thread that
    shares "DDP" and "device" with it helps nobody who cannot read it. Then
    the threads whose question shares most terms with `query` (a generic
    "process group not initialized" is better answered by its own thread than
    by one about SyncBN on one GPU that ends in the same error), the finer
    stance, the shorter text. Ties keep the KB's order."""
    asked = set(search_tokens(query)) if query else set()
    shared: dict[str, int] = {}

    def closeness(answer: AnswerRef) -> int:
        if answer.question not in shared:
            shared[answer.question] = len(asked & set(search_tokens(answer.question)))
        return shared[answer.question]

    return sorted(
        answers,
        key=lambda a: (
            STANCE_GROUP.get(a.stance, 1),
            a.lang != lang,
            -closeness(a) if asked else 0,
            STANCE_ORDER.get(a.stance, 9),
            len(a.text),
        ),
    )
