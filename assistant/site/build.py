"""Write the KB site: pages in English and Chinese, the assets and the search index.

    report = build_site(load_kb(kb_layers()), Path("public"))
    print(report.summary())   # "wrote 188 pages (45 causes, 49 threads; en + zh) to public"

OUT holds index.html, causes/<id>.html, threads/<name>.html, the same under
zh/, and assets/ (stylesheet, highlight styles, search.js, search-index.js).
A folder is written only when it is new, empty, or an earlier site (it holds
the marker file), and an earlier site's pages are replaced whole, so a cause
removed from the KB leaves no stale page behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from assistant.errors import UserError
from assistant.i18n import LANGS
from assistant.knowledge.kb import KnowledgeBase
from assistant.site import pages

MARKER = ".kb-site"  # marks a folder as this builder's output
GENERATED = ("index.html", "causes", "threads", "zh", "assets")
STATIC_ASSETS = ("site.css", "search.js")


@dataclass
class SiteReport:
    out: Path
    pages: int
    causes: int
    threads: int

    def summary(self) -> str:
        return (
            f"wrote {self.pages} pages ({self.causes} causes, {self.threads} threads; en + zh) "
            f"to {self.out}; open {self.out / 'index.html'} or serve the folder"
        )


def prepare_out(out: Path) -> None:
    """Make `out` ready: create it, or clear an earlier site; refuse any other folder."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise UserError(f"{out} is not empty and holds no earlier site; give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in GENERATED:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    (out / MARKER).write_text("written by `assistant kb site`; rebuilt whole each time\n")


def search_entries(kb: KnowledgeBase) -> list[dict]:
    """One entry per cause and thread: what search.js shows and the lowercased text it matches."""
    entries = []
    for cause in kb.causes.values():
        head = f"{cause.id} {cause.title} {cause.title_zh}"
        body = [cause.summary, cause.summary_zh, *cause.symptoms, *cause.signatures]
        entries.append(
            entry(
                "cause",
                cause.id,
                pages.cause_path(cause.id),
                cause.title,
                cause.title_zh,
                head,
                body,
            )
        )
    for thread in kb.threads:
        head = f"{thread.id} {thread.title}"
        body = [thread.question, *(a.text for a in thread.answers)]
        entries.append(
            entry("thread", thread.id, pages.thread_path(thread), thread.title, "", head, body)
        )
    return entries


def searchable(text: str) -> str:
    """As search.js compares: lowercase, "-" as a space, single spaces."""
    return " ".join(text.lower().replace("-", " ").split())


def entry(kind, entry_id, path, title, title_zh, head, body) -> dict:
    return {
        "kind": kind,
        "id": entry_id,
        "path": path,
        "title": title,
        "title_zh": title_zh,
        "head": searchable(head),
        "text": searchable(" ".join([head, *body])),
    }


def search_index_js(kb: KnowledgeBase) -> str:
    """The index as a script (works from file:// where fetch() of JSON does not)."""
    data = json.dumps(search_entries(kb), ensure_ascii=False, separators=(",", ":"))
    # "</" cannot close anything in a .js file, but keep the file inert if ever inlined.
    return "window.KB_SEARCH = " + data.replace("</", "<\\/") + ";\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def write_assets(kb: KnowledgeBase, out: Path) -> None:
    assets = out / "assets"
    source = resources.files("assistant.site") / "assets"
    for name in STATIC_ASSETS:
        write(assets / name, (source / name).read_text(encoding="utf-8"))
    write(assets / "highlight.css", pages.highlight_css())
    write(assets / "search-index.js", search_index_js(kb))


def build_site(kb: KnowledgeBase, out: Path) -> SiteReport:
    """Write the whole site for `kb` into `out` (see the module docstring)."""
    prepare_out(out)
    count = 0
    for lang in LANGS:
        base = out if lang == "en" else out / "zh"
        write(base / "index.html", pages.index_page(kb, lang))
        for cause in kb.causes.values():
            write(base / pages.cause_path(cause.id), pages.cause_page(cause, kb, lang))
        for thread in kb.threads:
            write(base / pages.thread_path(thread), pages.thread_page(thread, lang))
        count += 1 + len(kb.causes) + len(kb.threads)
    write_assets(kb, out)
    return SiteReport(out, count, len(kb.causes), len(kb.threads))
