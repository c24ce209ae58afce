"""Language of a question, and the interface strings in English and Chinese."""

from __future__ import annotations

import re

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"[A-Za-z]{2,}")

LANGS = ("en", "zh")


def has_cjk(text: str) -> bool:
    """Whether the text holds any Chinese (CJK) character."""
    return bool(_CJK.search(text))


def detect_lang(text: str) -> str:
    """'zh' when the person wrote in Chinese, else 'en'.

    A Chinese question usually quotes English error text, so a few CJK
    characters against many Latin words still count as Chinese when the
    CJK part is prose (several characters), not a stray symbol.
    """
    cjk = len(_CJK.findall(text))
    if cjk == 0:
        return "en"
    words = len(_LATIN_WORD.findall(text))
    return "zh" if cjk >= 4 or cjk * 2 >= words else "en"


STRINGS: dict[str, dict[str, str]] = {
    "root_error": {"en": "Root error", "zh": "根本错误"},
    "no_root_error": {"en": "No exception found in the text", "zh": "文本中没有找到异常"},
    "causes": {"en": "Likely causes", "zh": "可能的原因"},
    "no_causes": {"en": "No matching cause in the knowledge base", "zh": "知识库里没有匹配的原因"},
    "fix": {"en": "Fix", "zh": "修复方法"},
    "answers": {"en": "What the community said", "zh": "社区回答"},
    "evidence": {"en": "Evidence on this machine", "zh": "本机证据"},
    "contradicts": {"en": "contradicts", "zh": "与之矛盾"},
    "probes": {"en": "Probes", "zh": "探针"},
    "score": {"en": "score", "zh": "得分"},
    "verdict.confirmed": {"en": "confirmed here", "zh": "本机确认"},
    "verdict.ruled_out": {"en": "ruled out here", "zh": "本机已排除"},
    "verdict.inconclusive": {"en": "inconclusive", "zh": "无法判断"},
    "verdict.not_applicable": {"en": "not applicable", "zh": "不适用"},
    "verdict.not_run": {"en": "not probed", "zh": "未探测"},
    "stance.right": {"en": "right", "zh": "正确"},
    "stance.partly_right": {"en": "partly right", "zh": "部分正确"},
    "stance.wrong": {"en": "wrong", "zh": "错误"},
    "stance.unverified": {"en": "unverified", "zh": "未验证"},
    "stance.refuted_here": {"en": "contradicted by this machine", "zh": "被本机结果否定"},
    "stance.confirmed_here": {"en": "confirmed by this machine", "zh": "被本机结果证实"},
    "why": {"en": "Why it happens", "zh": "原因"},
    "risks": {"en": "What the fix risks", "zh": "修复的风险"},
    "references": {"en": "References", "zh": "参考资料"},
}


def t(key: str, lang: str = "en") -> str:
    """The interface string `key` in `lang` (English when missing)."""
    entry = STRINGS.get(key)
    if entry is None:
        return key
    return entry.get(lang) or entry["en"]
