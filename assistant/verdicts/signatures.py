"""The error patterns verdicts read: the KB's cause signatures, none of their own.

Whether an error text names a cause is decided by that cause's `signatures`
in kb/causes/*.yaml, the same regexes retrieval matches, so the two cannot
drift apart (they did: "AssertionError: Default process group is not
initialized" matched the KB but not the verdicts' own copy). A verdict that
needs a pattern beyond one cause names causes whose signatures together
express it (GPU_CAUSES). Compiling goes through assistant.knowledge.patterns,
the one place KB regexes are compiled (linear-time RE2 where installed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache

from assistant.knowledge.patterns import PatternSet
from assistant.knowledge.refines import taken_over

Signatures = Mapping[str, Iterable[str]]  # cause id -> regex sources, as the KB gives them

# Causes whose error texts only a job with a working GPU prints: two ranks on
# one CUDA device, CUDA running out of memory, tensors on cuda:0 and cuda:1,
# NCCL (a GPU backend) handed a CPU tensor, a CUDA device index out of range.
GPU_CAUSES = (
    "duplicate-gpu-per-rank",
    "cuda-out-of-memory",
    "hardcoded-device",
    "nccl-with-cpu-tensors",
    "world-size-exceeds-devices",
)


@lru_cache(maxsize=1024)
def compiled(patterns: tuple[str, ...]) -> PatternSet:
    """The patterns compiled once per process. A KB that lints clean compiles whole;
    a bad pattern from an unlinted layer is left out rather than failing a verdict."""
    return PatternSet.from_patterns(patterns, skip_invalid=True)


def patterns_of(signatures: Signatures, cause_ids: Iterable[str]) -> tuple[str, ...]:
    """The signatures of the named causes, in order, without repeats."""
    found = [p for cause_id in cause_ids for p in signatures.get(cause_id, ())]
    return tuple(dict.fromkeys(found))


def kb_signatures() -> dict[str, list[str]]:
    """The signatures of the KB files in force (empty when the KB cannot be read)."""
    # Imported here: doctor judges without any error text and never needs the KB.
    from assistant.knowledge.catalog import kb_signatures as read_kb_signatures

    return read_kb_signatures()


def kb_refinements() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The KB's refinements (catalog.kb_refinements), read as kb_signatures is."""
    from assistant.knowledge.catalog import kb_refinements as read_kb_refinements

    return read_kb_refinements()


def as_refined(signatures: Signatures, refinements: Mapping, text: str) -> Signatures:
    """The signatures as retrieval reads `text`: a cause that refines others and
    that the text names (its named_by words) takes their signatures, and they
    lose them (retrieve.Retriever.refined: SyncBatchNorm's "Default process
    group has not been initialized" is SyncBN's error in a report naming it).
    """
    result = {cause_id: list(patterns) for cause_id, patterns in signatures.items()}
    if not text:
        return result
    refines = {cid: general for cid, (general, _) in refinements.items() if cid in result}
    # Every cause with patterns counts as matched: a pattern handed over only
    # decides a verdict where it matches the text, so matching twice gains nothing.
    matched = [cause_id for cause_id, patterns in result.items() if patterns]

    def names(cause_id: str) -> bool:
        return compiled(tuple(refinements[cause_id][1])).search(text) is not None

    handed = taken_over(refines, matched, names)
    general_patterns = {cause_id: list(patterns) for cause_id, patterns in result.items()}
    for cause_id, general in handed.items():  # two special cases may share one general cause
        for g in general:
            result[cause_id] = list(dict.fromkeys([*result[cause_id], *general_patterns[g]]))
    for general in handed.values():
        for g in general:
            result[g] = []
    return result
