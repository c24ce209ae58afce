"""HTML for the KB site: every page of one language, every KB text escaped.

KB files come from many hands, so nothing from them reaches the page
unescaped: text goes through `esc` (html.escape, quotes included), code
through pygments (which escapes), and a reference becomes a link only when
its URL is http(s). Pages link by cause id (causes/<id>.html) and by the
thread's file name (threads/<name>.html), so links stay stable across builds.
"""

from __future__ import annotations

import hashlib
import html
import re
from dataclasses import dataclass

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from assistant.i18n import pick, translate
from assistant.knowledge.kb import Cause, KnowledgeBase, Thread, ThreadAnswer

# The site's own words; the rest (fix, answers, stance.*, ...) are the shared i18n.STRINGS.
WORDS = {
    "site": {"en": "DDP failure knowledge base", "zh": "DDP 故障知识库"},
    "other_lang": {"en": "中文", "zh": "English"},
    "search": {"en": "Search causes and threads…", "zh": "搜索原因和讨论…"},
    "causes": {"en": "Causes", "zh": "原因"},
    "threads": {"en": "Community threads", "zh": "社区讨论"},
    "why": {"en": "Why it happens", "zh": "原因说明"},
    "signatures": {"en": "Error signatures", "zh": "错误特征"},
    "symptoms": {"en": "How people report it", "zh": "常见描述"},
    "risks": {"en": "Risks of the fix", "zh": "修复的风险"},
    "probes": {"en": "Probes that test it", "zh": "检测它的探针"},
    "no_answers": {
        "en": "No community answer claims this cause yet.",
        "zh": "还没有社区回答提到这个原因。",
    },
    "question": {"en": "Question", "zh": "问题"},
    "claims": {"en": "claims", "zh": "认为原因是"},
    "advice": {"en": "advice", "zh": "建议"},
    "in_thread": {"en": "in thread", "zh": "出自讨论"},
    "source": {"en": "source", "zh": "来源"},
}
_FORMATTER = HtmlFormatter(cssclass="highlight")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_THREAD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


def word(key: str, lang: str) -> str:
    return translate(WORDS, key, lang)


def esc(text: str) -> str:
    """KB text as HTML text (quotes escaped too, so it is safe in attributes)."""
    return html.escape(text or "", quote=True)


def prose(text: str) -> str:
    """Paragraphs of escaped text; `inline code` kept as code."""
    parts = [p.strip() for p in re.split(r"\n\s*\n", text or "") if p.strip()]
    return "\n".join(f"<p>{with_inline_code(esc(p))}</p>" for p in parts)


def with_inline_code(escaped: str) -> str:
    """`code` spans of already escaped text as <code> (the backtick is no HTML character)."""
    return _INLINE_CODE.sub(r"<code>\1</code>", escaped)


def code_block(code: str) -> str:
    """Python code highlighted by pygments (which escapes it)."""
    return highlight(code, PythonLexer(), _FORMATTER)


def highlight_css() -> str:
    return _FORMATTER.get_style_defs(".highlight")


def thread_file_name(thread_id: str) -> str:
    """A file name for the thread: its id when that is a safe name, else a slug of it.

    Thread ids are free text in the schema; a path must never come from them as is.
    """
    if _THREAD_NAME.match(thread_id) and ".." not in thread_id:
        return thread_id
    slug = "-".join(re.findall(r"[a-z0-9]+", thread_id.lower()))[:60] or "thread"
    return f"{slug}-{hashlib.sha1(thread_id.encode()).hexdigest()[:8]}"


def cause_path(cause_id: str) -> str:
    return f"causes/{cause_id}.html"


def thread_path(thread: Thread) -> str:
    return f"threads/{thread_file_name(thread.id)}.html"


@dataclass
class Page:
    """Where a page sits (relative to its language's root) and its language."""

    path: str  # e.g. "causes/x.html", "index.html"
    lang: str

    @property
    def to_site_root(self) -> str:
        depth = self.path.count("/") + (1 if self.lang == "zh" else 0)
        return "../" * depth

    @property
    def to_lang_root(self) -> str:
        return "../" * self.path.count("/")

    def link(self, path: str) -> str:
        """A link to `path` in this page's language."""
        return self.to_lang_root + path

    @property
    def other_lang_link(self) -> str:
        return self.to_site_root + ("" if self.lang == "zh" else "zh/") + self.path


def layout(page: Page, title: str, body: str) -> str:
    root = page.to_site_root
    return f"""<!DOCTYPE html>
<html lang="{"zh-CN" if page.lang == "zh" else "en"}">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'">
<title>{esc(title)} · {esc(word("site", page.lang))}</title>
<link rel="stylesheet" href="{root}assets/site.css">
<link rel="stylesheet" href="{root}assets/highlight.css">
</head>
<body data-root="{root}" data-lang="{page.lang}">
<header>
<a class="home" href="{page.link("index.html")}">{esc(word("site", page.lang))}</a>
<div class="search"><input id="search" type="search" autocomplete="off" placeholder="{esc(word("search", page.lang))}" aria-label="{esc(word("search", page.lang))}"><ul id="results"></ul></div>
<a class="lang" href="{page.other_lang_link}">{word("other_lang", page.lang)}</a>
</header>
<main>
{body}
</main>
<script src="{root}assets/search-index.js"></script>
<script src="{root}assets/search.js"></script>
</body>
</html>
"""


def stance_badge(stance: str, lang: str) -> str:
    return f'<span class="stance stance-{esc(stance)}">{esc(word("stance." + stance, lang))}</span>'


def reference_item(title: str, url: str) -> str:
    if re.match(r"^https?://", url or "", re.IGNORECASE):
        return f'<li><a href="{esc(url)}" rel="noopener noreferrer">{esc(title)}</a></li>'
    return f"<li>{esc(title)} ({esc(url)})</li>"


def cause_page(cause: Cause, kb: KnowledgeBase, lang: str) -> str:
    page = Page(cause_path(cause.id), lang)
    title = pick(cause.title, cause.title_zh, lang)
    sections = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="id">{esc(cause.id)}</p>',
        f'<p class="summary">{esc(pick(cause.summary, cause.summary_zh, lang))}</p>',
        f"<h2>{word('why', lang)}</h2>",
        prose(pick(cause.why, cause.why_zh, lang)),
    ]
    if cause.signatures:
        items = "".join(f"<li><code>{esc(s)}</code></li>" for s in cause.signatures)
        sections += [f"<h2>{word('signatures', lang)}</h2>", f'<ul class="signatures">{items}</ul>']
    symptoms = "".join(f"<blockquote>{esc(s)}</blockquote>" for s in cause.symptoms)
    sections += [
        f"<h2>{word('symptoms', lang)}</h2>",
        symptoms,
        f'<h2 id="fix">{word("fix", lang)}</h2>',
        prose(pick(cause.fix, cause.fix_zh, lang)),
        code_block(cause.fix_code),
        f"<h2>{word('risks', lang)}</h2>",
        prose(cause.risks),
    ]
    if cause.probes:
        items = "".join(f"<li><code>assistant probe {esc(p)}</code></li>" for p in cause.probes)
        sections += [f"<h2>{word('probes', lang)}</h2>", f"<ul>{items}</ul>"]
    refs = "".join(reference_item(r.title, r.url) for r in cause.references)
    sections += [f"<h2>{word('references', lang)}</h2>", f"<ul>{refs}</ul>"]
    sections += [
        f'<h2 id="answers">{word("answers", lang)}</h2>',
        claimed_answers(cause.id, kb, page),
    ]
    return layout(page, title, "\n".join(sections))


def claimed_answers(cause_id: str, kb: KnowledgeBase, page: Page) -> str:
    """Every thread answer that claims the cause, with its stance and a link to its thread."""
    blocks = []
    for thread in kb.threads:
        for answer in thread.answers:
            if cause_id in answer.claims:
                where = page.link(thread_path(thread)) + f"#{esc(answer.id)}"
                origin = f'{word("in_thread", page.lang)} <a href="{where}">{esc(thread.title)}</a>'
                blocks.append(answer_block(answer, page, origin))
    return "\n".join(blocks) or f"<p>{word('no_answers', page.lang)}</p>"


def answer_block(answer: ThreadAnswer, page: Page, origin: str = "", anchor: bool = False) -> str:
    lang = page.lang
    meta = [stance_badge(answer.stance, lang), esc(answer.id), esc(answer.lang)]
    if origin:
        meta.append(origin)
    id_attribute = f' id="{esc(answer.id)}"' if anchor else ""
    lines = [
        f'<div class="answer"{id_attribute}>',
        f'<div class="meta">{" · ".join(meta)}</div>',
        prose(answer.text),
    ]
    if answer.note:
        lines.append(f'<div class="note">{esc(answer.note)}</div>')
    extras = []
    if answer.claims:
        links = ", ".join(
            f'<a href="{page.link(cause_path(c))}">{esc(c)}</a>' for c in answer.claims
        )
        extras.append(f"{word('claims', lang)}: {links}")
    if answer.advice:
        extras.append(f"{word('advice', lang)}: <code>{esc(answer.advice)}</code>")
    if answer.contradicts:
        links = ", ".join(f'<a href="#{esc(a)}">{esc(a)}</a>' for a in answer.contradicts)
        extras.append(f"{word('contradicts', lang)}: {links}")
    if extras:
        lines.append(f'<div class="meta">{" · ".join(extras)}</div>')
    lines.append("</div>")
    return "\n".join(lines)


def thread_page(thread: Thread, lang: str) -> str:
    page = Page(thread_path(thread), lang)
    body = [
        f"<h1>{esc(thread.title)}</h1>",
        f'<p class="id">{esc(thread.id)}</p>',
        f"<h2>{word('question', lang)}</h2>",
        prose(thread.question),
    ]
    if thread.source:
        body.append(f'<p class="id">{word("source", lang)}: {esc(thread.source)}</p>')
    body.append(f"<h2>{word('answers', lang)}</h2>")
    body += [answer_block(answer, page, anchor=True) for answer in thread.answers]
    return layout(page, thread.title, "\n".join(body))


def index_page(kb: KnowledgeBase, lang: str) -> str:
    page = Page("index.html", lang)
    causes = "".join(
        f'<li><a href="{cause_path(c.id)}">{esc(pick(c.title, c.title_zh, lang))}</a> '
        f'<span class="id">{esc(c.id)}</span><br>{esc(pick(c.summary, c.summary_zh, lang))}</li>'
        for c in sorted(kb.causes.values(), key=lambda c: c.id)
    )
    threads = "".join(
        f'<li><a href="{thread_path(t)}">{esc(t.title)}</a> '
        f'<span class="id">{esc(t.id)} · {len(t.answers)}</span></li>'
        for t in sorted(kb.threads, key=lambda t: t.id)
    )
    body = (
        f"<h1>{esc(word('site', lang))}</h1>"
        f"<h2>{word('causes', lang)} ({len(kb.causes)})</h2>"
        f'<ul class="index" id="cause-list">{causes}</ul>'
        f"<h2>{word('threads', lang)} ({len(kb.threads)})</h2>"
        f'<ul class="index" id="thread-list">{threads}</ul>'
    )
    return layout(page, word("site", lang), body)
