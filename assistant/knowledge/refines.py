"""The one rule of the KB's `refines` field (kb.Cause.refines), for every reader.

A special case that prints its general cause's error (SyncBatchNorm with no
process group prints "Default process group has not been initialized") takes
that error as its own in a report that names it (its `named_by` words):
retrieval hands it the general cause's signature score
(retrieve.Retriever.refined), the verdicts hand it the general cause's
signatures (verdicts.signatures.as_refined). No heavy imports: the verdicts
read it without loading the KB's schema.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence


def taken_over(
    refines: Mapping[str, Sequence[str]],
    matched: Collection[str],
    names: Callable[[str], bool],
) -> dict[str, list[str]]:
    """Per special case the report names, the general causes it refines that matched.

    refines: special case -> the general causes it refines.
    matched: the causes whose error the report shows.
    names: whether the report names a special case (its named_by words);
        asked only where a general cause matched.
    """
    handed: dict[str, list[str]] = {}
    for special, general in refines.items():
        taken = [cause for cause in general if cause in matched]
        if taken and names(special):
            handed[special] = taken
    return handed
