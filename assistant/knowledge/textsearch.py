"""CJK-aware tokens for SQLite FTS5.

FTS5's unicode61 tokenizer treats a run of Chinese characters as one token,
so "找不到设备" would never match "DDP 找不到设备了". We index and query with
our own tokens instead: lowercased Latin words and numbers, and overlapping
character bigrams of every CJK run ("找不", "不到", "到设", "设备").
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z][a-z0-9]+|[0-9]{2,}")
_CJK_RUN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]+")

STOPWORDS = frozenset(  # a word list reads best as text
    """the and for with that this you your are was were has have had not but from into
    when then than what which while will would can could should does did its it's our out
    all any how why who use used using get got just also only one two there their them
    they been being very more most some such here about after before over under on in of
    to is be as at by or an if so no do my me we it py line file""".split()  # noqa: SIM905
)


def search_tokens(text: str) -> list[str]:
    """Tokens for indexing and querying: Latin words and CJK bigrams."""
    lowered = text.lower()
    tokens = [w for w in _WORD.findall(lowered) if w not in STOPWORDS]
    for run in _CJK_RUN.findall(text):
        if len(run) == 1:
            tokens.append(run)
        else:
            tokens.extend(run[i : i + 2] for i in range(len(run) - 1))
    return tokens


def fts_query(
    text: str,
    doc_freq: dict[str, int] | None = None,
    limit: int = 16,
    max_df: int | None = None,
) -> str | None:
    """An FTS5 MATCH expression: distinct tokens OR-ed.

    With `doc_freq` (token -> number of chunks holding it), tokens the index
    lacks are dropped and the `limit` rarest are kept: they carry the meaning,
    and common ones would make bm25 score most of a large index. Tokens in
    more than `max_df` chunks are dropped outright (near-zero idf, all cost).
    """
    unique = list(dict.fromkeys(search_tokens(text)))
    if doc_freq is not None:
        cap = max_df if max_df is not None else float("inf")
        unique = sorted(
            (t for t in unique if 0 < doc_freq.get(t, 0) <= cap), key=lambda t: doc_freq[t]
        )
    unique = unique[:limit]
    if not unique:
        return None
    return " OR ".join(f'"{token}"' for token in unique)
