"""A bilingual term bridge: Chinese words of the DDP domain -> the English the KB uses.

The embedding model is English-only and most KB text is English, so a
Chinese question ("多卡训练卡住了") shares few tokens and little meaning
with the cause that answers it ("hangs with several GPUs"). The bridge
lists how people say DDP things in Chinese and the English words for them;
a query is expanded with the English words of the Chinese terms it holds,
for the lexical and the dense signal alike.

The list is data, kept with the KB (`kb/bridge.yaml`) so that a maintainer
edits it in a pull request like a cause; a team layer may add its own
`bridge.yaml` (later layers add to and override earlier ones).

Terms are found by greedy longest match over each run of Chinese text, so
"卡住" (hang) wins over "卡" inside it and "显存不足" (CUDA out of memory) over "显存".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from assistant.errors import UserError
from assistant.knowledge.files import Layers, as_layers

BRIDGE_FILE = "bridge.yaml"
MAX_TERM_CHARS = 8  # a longer key would be a phrase from one report, not a term
_CJK_RUN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]+")
_CJK_ONLY = re.compile(r"^[\u3400-\u9fff\uf900-\ufaff]+$")
_LATIN = re.compile(r"[A-Za-z]")
# A number before 卡 (card): "0卡" / "1号卡" name a GPU, "8卡" / "8张卡" count them.
# Digits are not Chinese characters, so no bridge key can hold them.
_NUMBERED_CARD = re.compile(r"(?<![A-Za-z\d.])(\d{1,3})\s*(号|张|块)?卡")
# An ordinal card: "第一张卡" / "第二块显卡" is GPU 0 / GPU 1 (people count from one).
_ORDINAL_CARD = re.compile(r"第\s*([一二三四五六七八]|[1-8])\s*(?:张|块|个)?\s*(?:显卡|卡|GPU)")
_ORDINALS = {c: n for n, c in enumerate("一二三四五六七八", start=1)}


@dataclass(frozen=True)
class Bridge:
    """Chinese term -> English words, with the longest key length for matching."""

    terms: dict[str, tuple[str, ...]]

    @property
    def longest(self) -> int:
        return max((len(key) for key in self.terms), default=0)

    def found(self, text: str) -> list[str]:
        """The bridge's Chinese terms in `text`, in order, longest match first."""
        longest = self.longest
        hits: list[str] = []
        for run in _CJK_RUN.findall(text):
            start = 0
            while start < len(run):
                for size in range(min(longest, len(run) - start), 0, -1):
                    if run[start : start + size] in self.terms:
                        hits.append(run[start : start + size])
                        start += size
                        break
                else:
                    start += 1
        return hits

    def english(self, text: str) -> list[str]:
        """The English words for the Chinese terms in `text`, each once, in order."""
        words = [word for term in self.found(text) for word in self.terms[term]]
        if self.terms:  # an empty bridge (a team KB without one) adds nothing
            words += numbered_cards(text)
        return list(dict.fromkeys(words))

    def expand(self, text: str) -> str:
        """`text` followed by the English of its Chinese terms (unchanged when none)."""
        words = self.english(text)
        return f"{text}\n{' '.join(words)}" if words else text


EMPTY = Bridge({})


def numbered_cards(text: str) -> list[str]:
    """English for numbered cards: "0卡" and "1号卡" -> "GPU 0", "GPU 1"; "8卡", "两张卡" stay counts.

    An ordinal names a card counted from one: "第一张显卡" is GPU 0.

    GPU 0 is the one people name most ("0卡显存占用高": extra memory on GPU 0),
    and index 0 is never a count.
    """
    words = []
    for ordinal in _ORDINAL_CARD.findall(text):
        position = _ORDINALS.get(ordinal) or int(ordinal)
        words.append(f"GPU {position - 1}")
    for number, kind in _NUMBERED_CARD.findall(text):
        index = int(number)
        if kind == "号" or (not kind and index == 0):
            words.append(f"GPU {index}")
        else:
            words.append(f"{index} GPUs")
    return words


def parse_bridge(data: object, source: str) -> dict[str, tuple[str, ...]]:
    """Validate one bridge file's content; a UserError names the first problem."""
    if not isinstance(data, dict) or set(data) != {"terms"} or not isinstance(data["terms"], dict):
        raise UserError(f"{source}: expected one key, `terms`, mapping Chinese terms to English")
    terms: dict[str, tuple[str, ...]] = {}
    for key, value in data["terms"].items():
        where = f"{source}: term {key!r}"
        if not isinstance(key, str) or not _CJK_ONLY.match(key):
            raise UserError(f"{where}: a key must be Chinese characters only")
        if len(key) > MAX_TERM_CHARS:
            raise UserError(
                f"{where}: longer than {MAX_TERM_CHARS} characters; bridge terms, not phrases"
            )
        words = [value] if isinstance(value, str) else value
        if not isinstance(words, list) or not words:
            raise UserError(f"{where}: give the English as a string or a non-empty list")
        for word in words:
            if not isinstance(word, str) or not _LATIN.search(word) or _CJK_RUN.search(word):
                raise UserError(f"{where}: {word!r} is not English text")
        if len(set(words)) != len(words):
            raise UserError(f"{where}: an English word is listed twice")
        terms[key] = tuple(w.strip() for w in words)
    return terms


def read_bridge_file(path: Path) -> dict[str, tuple[str, ...]]:
    """One layer's bridge file, validated (an absent file is an empty bridge)."""
    import yaml

    if not path.is_file():
        return {}
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_key_loader())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the term bridge: {exc}") from None
    except yaml.YAMLError as exc:  # its text spans lines; one line names the place
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or "parse error"
        raise UserError(f"{where}: the term bridge is not valid YAML ({problem})") from None
    return parse_bridge(data, str(path))


def _unique_key_loader():
    """A SafeLoader that refuses a key given twice (YAML would keep the last one silently).

    On libyaml's loader when PyYAML has it: the bridge is read on every cold
    start, and the pure-Python parser took ~0.12 s of it.
    """
    import yaml

    class UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_bridge(layers: Layers) -> Bridge:
    """The bridge of a KB: every layer's `bridge.yaml`, later layers overriding."""
    return _load_cached(tuple(_stamp(root / BRIDGE_FILE) for root in as_layers(layers)))


def _stamp(path: Path) -> tuple[str, float]:
    """A file and its modification time: an edited bridge is read again."""
    try:
        return str(path), path.stat().st_mtime
    except OSError:
        return str(path), 0.0


@lru_cache(maxsize=8)
def _load_cached(stamps: tuple[tuple[str, float], ...]) -> Bridge:
    merged: dict[str, tuple[str, ...]] = {}
    for path, _ in stamps:
        merged.update(read_bridge_file(Path(path)))
    return Bridge(merged)
