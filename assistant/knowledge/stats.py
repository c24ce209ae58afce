"""Coverage figures of the KB for `assistant kb stats`."""

from __future__ import annotations

from assistant.i18n import has_cjk
from assistant.knowledge.kb import KnowledgeBase


def kb_stats(kb: KnowledgeBase) -> dict:
    """Per cause: titles, whether it has Chinese, signature/answer/probe counts, the layer
    it came from (`source`) and the layers that extend it; plus totals."""
    answers_per_cause: dict[str, int] = {cid: 0 for cid in kb.causes}
    zh_answers: dict[str, int] = {cid: 0 for cid in kb.causes}
    for thread in kb.threads:
        for answer in thread.answers:
            for cid in answer.claims:
                answers_per_cause[cid] = answers_per_cause.get(cid, 0) + 1
                if answer.lang == "zh":
                    zh_answers[cid] = zh_answers.get(cid, 0) + 1
    rows = [
        {
            "id": cause.id,
            "title": cause.title,
            "title_zh": cause.title_zh,
            "has_zh": bool(
                cause.title_zh and cause.summary_zh and any(has_cjk(s) for s in cause.symptoms)
            ),
            "signatures": len(cause.signatures),
            "answers": answers_per_cause[cause.id],
            "probes": list(cause.probes),
            "source": str(kb.sources.get(cause.id, "")),
            "extended_by": [str(layer) for layer in kb.extended_by.get(cause.id, [])],
        }
        for cause in kb.causes.values()
    ]
    totals = {
        "causes": len(rows),
        "threads": len(kb.threads),
        "answers": sum(len(t.answers) for t in kb.threads),
        "signatures": sum(r["signatures"] for r in rows),
        "causes_with_zh": sum(r["has_zh"] for r in rows),
        "causes_with_zh_answers": sum(1 for v in zh_answers.values() if v),
        "causes_without_answers": [r["id"] for r in rows if not r["answers"]],
        "causes_without_probes": [r["id"] for r in rows if not r["probes"]],
    }
    return {"causes": rows, "totals": totals}
