"""The one place that chooses between English and Chinese.

    lang = detect_lang(question)
    t("root_error", lang)                          # a shared interface word
    translate(UI, "turn.done", lang, confirmed=1)  # a front end's own table, same rules
    pick(cause.title, cause.title_zh, lang)        # a KB field and its Chinese twin
    cause_title(cause, lang)
    verdict_label(cause, lang, findings)           # "confirmed · tested on this machine"
    stance_label(answer, lang)                     # "[wrong] · refuted on this machine"

Every front end (the CLI renderer, the chat, the Markdown export) takes its
words from here, so a Chinese turn never mixes in an English title because
one of them chose differently. Nothing here imports Textual or rich.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Protocol

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"[A-Za-z]{2,}")

LANGS = ("en", "zh")
# The question an answer was given to is shown beside its stance, this short.
QUESTION_CHARS = 48

Table = Mapping[str, Mapping[str, str]]


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


def pick(en: str, zh: str, lang: str) -> str:
    """`zh` in a Chinese interface when there is one, else `en`."""
    return zh if lang == "zh" and zh else en


STRINGS: dict[str, dict[str, str]] = {
    "root_error": {"en": "Root error", "zh": "根本错误"},
    # Only a line that starts with an exception (or a torchrun failure record) is a root
    # error; one quoted inside a sentence is searched with the rest of the words.
    "no_root_error": {
        "en": "No line of the text starts with an exception",
        "zh": "文本中没有以异常开头的行",
    },
    "causes": {"en": "Likely causes", "zh": "可能的原因"},
    "no_causes": {"en": "No matching cause in the knowledge base", "zh": "知识库里没有匹配的原因"},
    "fix": {"en": "Fix", "zh": "修复方法"},
    "answers": {"en": "What the community said", "zh": "社区回答"},
    "evidence": {"en": "Evidence", "zh": "证据"},
    "contradicts": {"en": "contradicts", "zh": "与之矛盾"},
    "probes": {"en": "Probes", "zh": "探针"},
    "score": {"en": "score", "zh": "得分"},
    # The verdict alone; verdict_label adds its source.
    "verdict_word.confirmed": {"en": "confirmed", "zh": "已确认"},
    "verdict_word.ruled_out": {"en": "ruled out", "zh": "已排除"},
    "verdict_word.inconclusive": {"en": "inconclusive", "zh": "无法判断"},
    "verdict_word.not_applicable": {"en": "not applicable", "zh": "不适用"},
    "verdict_word.not_run": {"en": "not checked", "zh": "未检查"},
    # Where a verdict comes from (results.VerdictSource), in words a user
    # cannot misread: only a probe "tested on this machine".
    "source.probe": {"en": "tested on this machine", "zh": "已在本机测试"},
    "source.error": {"en": "the error says so", "zh": "报错本身表明"},
    "source.script": {"en": "your script, line {line}", "zh": "你的脚本第 {line} 行"},
    "source.script_no_line": {"en": "your script", "zh": "你的脚本"},
    "stance.right": {"en": "right", "zh": "正确"},
    "stance.partly_right": {"en": "partly right", "zh": "部分正确"},
    "stance.wrong": {"en": "wrong", "zh": "错误"},
    "stance.unverified": {"en": "unverified", "zh": "未验证"},
    # What this machine showed about an answer's advice (AnswerRef.here).
    "here.refuted_here": {"en": "refuted on this machine", "zh": "本机测试否定"},
    "here.confirmed_here": {"en": "confirmed on this machine", "zh": "本机测试证实"},
    "stance.for": {"en": "on “{question}”", "zh": "针对“{question}”"},
    "confidence.high": {"en": "confidence: high", "zh": "把握：高"},
    "confidence.medium": {"en": "confidence: medium", "zh": "把握：中"},
    "confidence.low": {"en": "confidence: low", "zh": "把握：低"},
    "decide.ask": {
        "en": "To tell these apart, paste: {items}",
        "zh": "为了区分这几个原因，请粘贴：{items}",
    },
    "decide.join": {"en": "; ", "zh": "；"},
    "why": {"en": "Why it happens", "zh": "原因"},
    "risks": {"en": "What the fix risks", "zh": "修复的风险"},
    "references": {"en": "References", "zh": "参考资料"},
    # The Markdown report (assistant.chat.export).
    "report.title": {"en": "DDP assistant report", "zh": "DDP 助手报告"},
    "report.verdicts": {"en": "Verdicts", "zh": "判定"},
    "report.cause": {"en": "Cause", "zh": "原因"},
    "report.verdict": {"en": "Verdict", "zh": "判定"},
    "report.environment": {"en": "Environment (measured by probes)", "zh": "环境（探针测得）"},
    "report.no_probes": {"en": "No probe has run yet.", "zh": "还没有运行探针。"},
    "report.findings": {"en": "Training script findings", "zh": "训练脚本检查结果"},
    "report.questions": {"en": "Questions asked", "zh": "提出的问题"},
    "report.launches": {"en": "Launches watched", "zh": "监视过的启动"},
    "report.lines": {"en": "lines", "zh": "行"},
    "report.no_result": {"en": "No answer yet.", "zh": "还没有答案。"},
    "report.rank": {"en": "rank", "zh": "rank"},
}


def translate(table: Table, key: str, lang: str = "en", **values: object) -> str:
    """`key` from `table` (else the shared STRINGS) in `lang`, English when missing.

    An unknown key comes back as itself, so a missing string shows, never crashes.
    """
    entry = table.get(key) or STRINGS.get(key)
    if entry is None:
        return key
    text = entry.get(lang) or entry["en"]
    return text.format(**values) if values else text


def t(key: str, lang: str = "en", **values: object) -> str:
    """The shared interface string `key` in `lang` (English when missing)."""
    return translate(STRINGS, key, lang, **values)


# -- KB text in the interface language ----------------------------------------------


class Titled(Protocol):
    """What cause_title/cause_summary read (assistant.results.CauseResult)."""

    id: str
    title: str
    title_zh: str
    summary: str
    summary_zh: str


def cause_title(cause: Titled, lang: str) -> str:
    """The cause's title in `lang` when the KB has one."""
    return pick(cause.title, cause.title_zh, lang)


def cause_summary(cause: Titled, lang: str) -> str:
    return pick(cause.summary, cause.summary_zh, lang)


def entry_text(entry: Mapping, key: str, lang: str) -> str:
    """A KB entry field in `lang` ('why' -> 'why_zh' in Chinese when present)."""
    return pick(str(entry.get(key) or ""), str(entry.get(f"{key}_zh") or ""), lang)


# -- verdicts and stances, honestly worded ----------------------------------------------


def source_words(source: str | None, lang: str, line: int | None = None) -> str:
    """Where a verdict comes from: '' when not judged."""
    if source == "script":
        if line is None:
            return t("source.script_no_line", lang)
        return t("source.script", lang, line=line)
    if source in ("probe", "error"):
        return t(f"source.{source}", lang)
    return ""


def script_line(cause_id: str, findings: Iterable) -> int | None:
    """The line of the first static finding about `cause_id` (Finding.line)."""
    for finding in findings:
        if finding.cause_id == cause_id and getattr(finding, "source", "script") == "script":
            return finding.line
    return None


def verdict_label(cause, lang: str, findings: Iterable = ()) -> str:
    """'confirmed · tested on this machine', 'ruled out · the error says so', 'not checked'."""
    verdict = cause.verdict
    word = t(f"verdict_word.{verdict.verdict}", lang)
    where = source_words(verdict.source, lang, script_line(cause.id, findings))
    return f"{word} · {where}" if where else word


def here_outcome(answer) -> str:
    """What this machine showed about an answer's advice: '', confirmed_here, refuted_here.

    Older results (and history saved before `here` existed) wrote the
    outcome over the stance; read it from there too.
    """
    here = getattr(answer, "here", "")
    if here:
        return here
    return answer.stance if answer.stance in ("confirmed_here", "refuted_here") else ""


def community_stance(answer) -> str:
    """The community's stance on an answer ('' when only the machine's outcome is known)."""
    return "" if answer.stance in ("confirmed_here", "refuted_here") else answer.stance


def stance_label(answer, lang: str, with_question: bool = True) -> str:
    """'[wrong] on “DDP can't find the device…” · refuted on this machine'.

    The stance is about the question the answer was given to, so that
    question is named (unless the caller shows it on a line of its own:
    `with_question=False` and `asked_for`); the machine's outcome stands
    beside the stance, never over it.
    """
    parts = []
    stance = community_stance(answer)
    if stance:
        badge = f"[{t(f'stance.{stance}', lang)}]"
        question = asked_for(answer, lang) if with_question else ""
        parts.append(f"{badge} {question}" if question else badge)
    here = here_outcome(answer)
    if here:
        parts.append(t(f"here.{here}", lang))
    return " · ".join(parts)


def asked_for(answer, lang: str) -> str:
    """'on “<the thread question, shortened>”' ('' when the answer has no question)."""
    question = getattr(answer, "question", "")
    return t("stance.for", lang, question=short(question, QUESTION_CHARS)) if question else ""


def source_and_evidence(cause, lang: str, findings: Iterable = ()) -> str:
    """The first evidence line, led by where it comes from ('tested on this machine: ...')."""
    verdict = cause.verdict
    where = source_words(verdict.source, lang, script_line(cause.id, findings))
    first = verdict.evidence[0] if verdict.evidence else ""
    if where and first:
        return f"{where}{pick(': ', '：', lang)}{first}"
    return where or first


def decide_question(decide: Iterable[str], lang: str) -> str:
    """The one follow-up question that asks for what would tell the causes apart."""
    items = [item for item in decide if item]
    if not items:
        return ""
    return t("decide.ask", lang, items=t("decide.join", lang).join(items))


def short(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"
