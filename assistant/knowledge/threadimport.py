"""`assistant kb import-thread`: a forum thread in plain text becomes a KB thread file.

    thread = parse_thread(text)                 # question + answers, one per author voice
    draft = draft_thread(text, "my-thread", ranker=engine)  # parses, then proposes
    write_new_file(folder / "threads" / "my-thread.yaml", draft.yaml)

The text is the question, then the answers, separated by blank lines (as in
shared/seeds/000_0d95b9825ebdd6ac.txt). One person's answer may run over
several paragraphs, so a paragraph that opens as a continuation ("另外...",
"还有...", "Also, ...") joins the answer before it. Where the text marks its
authors (a line such as "alice wrote:", "@bob:", "--- carol ---",
"张三 回复："), those lines alone separate the answers.

Every proposal is for a person to review, and the file says so: the causes
an answer claims come from retrieval, sentence by sentence, each with its
confidence as a comment; advice tags come from what the answer tells the
reader to do with set_device; two answers contradict when their advice
differs. Every stance is `unverified`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from assistant.i18n import detect_lang
from assistant.knowledge.scaffold import yaml_field

# A paragraph that continues the previous answer rather than starting another.
CONTINUATION = re.compile(
    r"^\s*(?:另外|还有|此外|而且|再者|同时|最后|补充|建议你|PS\b|P\.S\.|"
    r"(?:Also|Additionally|Another thing|Besides|Finally|Moreover|Furthermore|Edit|Update)\b)",
    re.IGNORECASE,
)
# Lines that name an answer's author; where present they, not blank lines, separate answers.
AUTHOR_LINE = re.compile(
    r"^\s*(?:-{3,}\s*[^-\s].*?-*|@[\w.-]{1,40}\s*[:：]"
    r"|[\w .-]{1,40}\s+(?:wrote|says|answered|replied)\s*[:：]?"
    r"|\S{1,20}\s*(?:回复|回答|写道|说)\s*[:：])\s*$",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[。！？；!?;])|(?<=\.)\s+|\n+")
MIN_SENTENCE_CHARS = 8

# Retrieval's fused score (0..1) an answer or sentence must reach for its top
# cause to count as a claim. Prose matches no signature, so its scores top out
# at 0.5 (first in both the lexical and the dense ranking). Measured on the 48
# hand-tagged KB threads, each left out of the index while imported (retrieval
# of 8cbb544): 0.35 gives claims P 0.53 / R 0.71 (F1 0.61), 0.4 P 0.59 / R 0.67
# (F1 0.63), 0.5 P 0.75 / R 0.55 (F1 0.63). 0.4 keeps most of the recall: a
# reviewer deletes a wrong claim more easily than finding a missing one.
CLAIM_MIN_SCORE = 0.4
# The KB's own signals only: an answer is not a user's report (the reports
# signal learned those), and the threshold above was measured on these three.
KB_SIGNALS = ("signature", "lexical", "dense")
MAX_CLAIMS = 8
MAX_AUTHOR_LINE = 120  # characters; the longest author line a thread plausibly has

# Not a bare "device": "删掉 device_ids 参数" is not about set_device.
SET_DEVICE = r"(?:torch\.cuda\.)?set_device|设(?:置)?设备|设device"
INIT = r"(?:dist\.)?init_process_group|初始化(?:进程组)?|init"
REMOVE_SET_DEVICE = re.compile(
    rf"(?:去掉|删掉|删除|移除|不需要(?:手动)?调?|别手动设|不用(?:手动)?调?)[^。，,]{{0,12}}(?:{SET_DEVICE})"
    rf"|(?:{SET_DEVICE})[^。]{{0,6}}(?:去掉|删掉|删除|那行)"
    rf"|\b(?:remove|drop|delete|get rid of|no need (?:to|for)|don'?t (?:need to )?call)\b[^.]{{0,30}}set_device",
    re.IGNORECASE,
)
# Each gives the order it recommends: device first ("before") or init first ("after").
ORDER_RULES = [
    (
        re.compile(
            rf"先\s*(?:torch\.cuda\.)?(?:{SET_DEVICE}).{{0,20}}?再.{{0,6}}(?:{INIT})", re.IGNORECASE
        ),
        "before",
    ),
    (re.compile(rf"先\s*(?:{INIT}).{{0,20}}?再.{{0,6}}(?:{SET_DEVICE})", re.IGNORECASE), "after"),
    (
        re.compile(
            rf"(?:{SET_DEVICE})\s*(?:放到|放在|移到|挪到)\s*(?:{INIT})\s*(?:后面|之后|后)",
            re.IGNORECASE,
        ),
        "after",
    ),
    (
        re.compile(
            rf"(?:{SET_DEVICE})\s*(?:放到|放在|移到|挪到)\s*(?:{INIT})\s*(?:前面|之前|前)",
            re.IGNORECASE,
        ),
        "before",
    ),
    (
        re.compile(rf"(?:{INIT})\s*(?:之前|前面|以前)[^。]{{0,12}}(?:{SET_DEVICE})", re.IGNORECASE),
        "before",
    ),
    (
        re.compile(rf"(?:{INIT})\s*(?:之后|后面|以后)[^。]{{0,12}}(?:{SET_DEVICE})", re.IGNORECASE),
        "after",
    ),
    (
        re.compile(
            r"set_device\b[^。\n]{0,60}?\bbefore\b[^.]{0,20}init_process_group", re.IGNORECASE
        ),
        "before",
    ),
    (
        re.compile(
            r"set_device\b[^。\n]{0,60}?\bafter\b[^.]{0,20}init_process_group", re.IGNORECASE
        ),
        "after",
    ),
    (
        re.compile(r"init_process_group\b[^.]{0,30}\bbefore\b[^.]{0,20}set_device", re.IGNORECASE),
        "after",
    ),
    (
        re.compile(r"init_process_group\b[^.]{0,30}\bafter\b[^.]{0,20}set_device", re.IGNORECASE),
        "before",
    ),
]
ADVICE_FOR_ORDER = {"before": "set-device-before-init", "after": "set-device-after-init"}
# Advice about where set_device goes is a claim about this cause, whatever retrieval says.
ADVICE_CAUSE = "set-device-order"


@dataclass
class ParsedThread:
    """A thread as written: the question and one text per answer (author voice)."""

    question: str
    answers: list[str]


@dataclass
class Claim:
    cause_id: str
    confidence: float  # retrieval's fused score, 0..1


@dataclass
class AnswerDraft:
    id: str
    text: str
    lang: str
    claims: list[Claim]
    advice: str = ""
    contradicts: list[str] = field(default_factory=list)


class CauseRanker(Protocol):
    """What import needs of retrieval: causes with a score for a text (Engine.ask)."""

    def ask(self, query: str, top: int = 5, signals: tuple[str, ...] = KB_SIGNALS): ...


def slug(name: str) -> str:
    """A thread id from a file name: lowercase words joined by '-' ("000_0d95b98" -> "000-0d95b98")."""
    words = re.findall(r"[a-z0-9]+", name.lower())
    return "-".join(words) or "thread"


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, trimmed, empty ones dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def parse_thread(text: str) -> ParsedThread:
    """Split a plain-text thread into its question and answers (see the module docstring)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if any(is_author_line(line) for line in lines):
        return _split_by_author_lines(lines)
    parts = paragraphs(text)
    if not parts:
        return ParsedThread("", [])
    answers: list[str] = []
    for part in parts[1:]:
        if answers and CONTINUATION.match(part):
            answers[-1] += "\n\n" + part
        else:
            answers.append(part)
    return ParsedThread(parts[0], answers)


def is_author_line(line: str) -> bool:
    """A line that starts a new post ("--- Alice ---", "@bob:", "Carol wrote:", "张三 回复：").

    Such lines are short; a long line is never one, and is not matched at all,
    so that a pasted thread's huge lines cost no backtracking.
    """
    return len(line) <= MAX_AUTHOR_LINE and AUTHOR_LINE.match(line) is not None


def _split_by_author_lines(lines: list[str]) -> ParsedThread:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if is_author_line(line):
            blocks.append([])
        else:
            blocks[-1].append(line)
    texts = ["\n\n".join(paragraphs("\n".join(block))) for block in blocks]
    question, answers = texts[0], [t for t in texts[1:] if t]
    return ParsedThread(question, answers)


def sentences(text: str) -> list[str]:
    """The answer's sentences (Chinese and English punctuation), long enough to mean something."""
    return [s.strip() for s in SENTENCE_END.split(text) if len(s.strip()) >= MIN_SENTENCE_CHARS]


def propose_claims(text: str, ranker: CauseRanker) -> list[Claim]:
    """Causes an answer claims: the top cause of the whole answer and of each sentence,
    where retrieval is confident enough, best first."""
    best: dict[str, float] = {}
    for piece in [text, *sentences(text)]:
        causes = ranker.ask(piece, top=1, signals=KB_SIGNALS).causes
        if causes and causes[0].score >= CLAIM_MIN_SCORE:
            cause = causes[0]
            best[cause.id] = max(best.get(cause.id, 0.0), round(cause.score, 2))
    ordered = sorted(best.items(), key=lambda item: (-item[1], item[0]))[:MAX_CLAIMS]
    return [Claim(cid, score) for cid, score in ordered]


def propose_advice(text: str) -> str:
    """The set_device advice an answer gives, as a KB advice tag ('' when none).

    Removing set_device wins over an order; of several orders the last one
    stated is the advice ("I had set_device first; moving init first fixed it").
    """
    if REMOVE_SET_DEVICE.search(text):
        return "remove-set-device"
    found = [(m.start(), order) for rule, order in ORDER_RULES for m in rule.finditer(text)]
    if not found:
        return ""
    return ADVICE_FOR_ORDER[max(found)[1]]


def propose_contradictions(answers: list[AnswerDraft]) -> None:
    """Answers whose advice differs contradict each other (both sides list it)."""
    for answer in answers:
        answer.contradicts = [
            other.id
            for other in answers
            if other is not answer
            and answer.advice
            and other.advice
            and other.advice != answer.advice
        ]


def with_advice_claim(claims: list[Claim], advice: str) -> list[Claim]:
    """An answer with set_device advice claims set-device-order (confidence 1: its own words)."""
    if not advice:
        return claims
    others = [c for c in claims if c.cause_id != ADVICE_CAUSE]
    return [Claim(ADVICE_CAUSE, 1.0), *others][:MAX_CLAIMS]


def draft_answer(answer_id: str, text: str, ranker: CauseRanker) -> AnswerDraft:
    advice = propose_advice(text)
    claims = with_advice_claim(propose_claims(text, ranker), advice)
    return AnswerDraft(answer_id, text, detect_lang(text), claims, advice)


def draft_answers(thread: ParsedThread, ranker: CauseRanker) -> list[AnswerDraft]:
    drafts = [draft_answer(f"a{i}", text, ranker) for i, text in enumerate(thread.answers, start=1)]
    propose_contradictions(drafts)
    return drafts


def thread_title(question: str, limit: int = 80) -> str:
    first = question.strip().splitlines()[0] if question.strip() else ""
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def _indented(block: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line if line else line for line in block.splitlines())


def render_answer(answer: AnswerDraft) -> str:
    lines = [
        f"- id: {answer.id}",
        _indented(yaml_field("lang", answer.lang)),
        _indented(yaml_field("text", answer.text)),
    ]
    if answer.claims:
        lines.append("  claims:  # proposed by retrieval: keep the ones the answer really makes")
        lines += [f"  - {c.cause_id}  # confidence {c.confidence:.2f}" for c in answer.claims]
    else:
        lines.append(
            "  claims: []  # retrieval found no cause with confidence; add any the answer makes"
        )
    lines.append("  stance: unverified")
    if answer.advice:
        lines.append(f"  advice: {answer.advice}  # proposed from the answer's wording")
    if answer.contradicts:
        lines.append("  contradicts:  # proposed: their set_device advice differs")
        lines += [f"  - {other}" for other in answer.contradicts]
    return "\n".join(lines)


def render_thread_yaml(
    thread_id: str, thread: ParsedThread, answers: list[AnswerDraft], source: str
) -> str:
    """The thread file: the text verbatim, the proposals marked as proposals."""
    header = [
        f"# Imported by `assistant kb import-thread` from {source}; {len(answers)} answers.",
        "# Claims, advice and contradictions are proposals: review them, then set each stance.",
        yaml_field("id", thread_id),
        yaml_field("title", thread_title(thread.question)),
        yaml_field("lang", detect_lang(thread.question)),
        yaml_field("source", source),
        yaml_field("question", thread.question),
        "answers:",
    ]
    return "\n".join(header + [render_answer(a) for a in answers]) + "\n"


@dataclass
class ThreadDraft:
    thread_id: str
    parsed: ParsedThread
    answers: list[AnswerDraft]
    yaml: str


def draft_thread(text: str, thread_id: str, ranker: CauseRanker, source: str = "") -> ThreadDraft:
    """Parse the thread's text and propose claims, advice and contradictions per answer."""
    from assistant.errors import UserError

    parsed = parse_thread(text)
    if not parsed.question:
        raise UserError("the thread is empty: give a text file with the question and its answers")
    if not parsed.answers:
        raise UserError(
            "the thread has no answers: separate the question and each answer by a blank line"
        )
    answers = draft_answers(parsed, ranker)
    return ThreadDraft(
        thread_id, parsed, answers, render_thread_yaml(thread_id, parsed, answers, source)
    )
