"""`assistant kb site`: the pages, links, escaping and search index, read from the files.

The browser test (test_site_browser.py) checks the same site renders, searches
and links in a real Chromium.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from kbsite_hostile import HOSTILE_ID, HOSTILE_THREAD_ID, REPO_KB

from assistant.cli import main
from assistant.knowledge.kb import load_kb
from assistant.site.build import MARKER, build_site
from assistant.site.pages import thread_file_name

# Anything that would run if a KB text reached the page unescaped.
INJECTED = re.compile(
    r"<script>window|<img src=x|<iframe|<b>|<em>|href=\"javascript:", re.IGNORECASE
)


@pytest.fixture
def site(tmp_path, hostile_team) -> tuple[Path, object]:
    kb = load_kb([REPO_KB, hostile_team])
    out = tmp_path / "public"
    build_site(kb, out)
    return out, kb


def test_a_page_per_cause_and_thread_in_both_languages(site):
    out, kb = site
    for cause_id in kb.causes:
        assert (out / "causes" / f"{cause_id}.html").is_file()
        assert (out / "zh" / "causes" / f"{cause_id}.html").is_file()
    for thread in kb.threads:
        name = thread_file_name(thread.id)
        assert (out / "threads" / f"{name}.html").is_file()
        assert (out / "zh" / "threads" / f"{name}.html").is_file()
    assert len(list((out / "causes").glob("*.html"))) == len(kb.causes)


def test_cause_page_holds_the_document_and_its_answers(site):
    out, kb = site
    cause = kb.causes["duplicate-gpu-per-rank"]
    en = (out / "causes/duplicate-gpu-per-rank.html").read_text("utf-8")
    zh = (out / "zh/causes/duplicate-gpu-per-rank.html").read_text("utf-8")
    assert f"<h1>{cause.title}</h1>" in en and f"<h1>{cause.title_zh}</h1>" in zh
    assert 'class="highlight"' in en  # fix_code through pygments
    assert '<span class="n">local_rank</span>' in en
    # The seed thread's answers that claim it, with their stance and a link to the thread.
    assert "stance-right" in en and "stance-partly_right" in en
    assert 'href="../threads/seed-000-ddp-cant-find-device.html#a7"' in en
    assert 'href="../../causes/duplicate-gpu-per-rank.html"' in zh  # language switch
    assert 'href="../zh/causes/duplicate-gpu-per-rank.html"' in en


def test_thread_page_links_claims_and_contradictions(site):
    out, _ = site
    page = (out / "threads/seed-000-ddp-cant-find-device.html").read_text("utf-8")
    assert page.count('class="answer"') == 8
    assert '<div class="answer" id="a8">' in page
    assert 'href="../causes/set-device-order.html"' in page
    assert 'href="#a2"' in page  # a8 contradicts a2
    assert "<code>set-device-before-init</code>" in page


def test_every_kb_text_is_escaped(site):
    out, _ = site
    for page in out.rglob("*.html"):
        text = page.read_text("utf-8")
        assert not INJECTED.search(text), f"{page}: {INJECTED.search(text).group(0)}"
    cause_page = (out / f"causes/{HOSTILE_ID}.html").read_text("utf-8")
    assert "&lt;script&gt;window.kbSitePwned = 1&lt;/script&gt;" in cause_page
    assert 'href="https://example.org/docs?a=1&amp;b=&lt;2&gt;"' in cause_page
    assert "A link that runs code (javascript:window.kbSitePwned=6)" in cause_page


def test_a_thread_id_never_becomes_a_path(site, tmp_path):
    out, _ = site
    name = thread_file_name(HOSTILE_THREAD_ID)
    assert re.fullmatch(r"[a-z0-9-]+", name)
    assert (out / "threads" / f"{name}.html").is_file()
    assert not list(tmp_path.glob("outside*"))


def test_search_index_lists_every_cause_and_thread(site):
    out, kb = site
    text = (out / "assets/search-index.js").read_text("utf-8")
    assert text.startswith("window.KB_SEARCH = ")
    entries = json.loads(
        text.removeprefix("window.KB_SEARCH = ").rstrip().rstrip(";").replace("<\\/", "</")
    )
    assert {e["id"] for e in entries if e["kind"] == "cause"} == set(kb.causes)
    assert len([e for e in entries if e["kind"] == "thread"]) == len(kb.threads)
    assert "</" not in text  # inert even if a page ever inlined it
    for asset in ("site.css", "search.js", "highlight.css"):
        assert (out / "assets" / asset).stat().st_size > 0
    # No page loads anything from the network (references are links a reader may follow).
    for page in out.rglob("*.html"):
        assert not re.search(r'(?:src="|<link [^>]*href=")(?:https?:)?//', page.read_text("utf-8"))


def test_rebuild_replaces_the_site_and_refuses_a_foreign_folder(tmp_path, hostile_team):
    out = tmp_path / "public"
    build_site(load_kb([REPO_KB, hostile_team]), out)
    assert (out / f"causes/{HOSTILE_ID}.html").exists() and (out / MARKER).exists()
    build_site(load_kb([REPO_KB]), out)  # the team cause is gone: so is its page
    assert not (out / f"causes/{HOSTILE_ID}.html").exists()
    foreign = tmp_path / "docs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["kb", "site", str(foreign)])
    assert result.exit_code == 2
    assert "not empty and holds no earlier site" in result.output
    assert (foreign / "notes.txt").read_text() == "mine"


def test_cli_builds_the_layered_kb(tmp_path, hostile_team):
    out = tmp_path / "site"
    result = CliRunner().invoke(main, ["kb", "site", str(out), "--kb", str(hostile_team)])
    assert result.exit_code == 0, result.output
    causes = len(load_kb([REPO_KB]).causes) + 1
    assert f"({causes} causes, " in result.output
    assert (out / f"zh/causes/{HOSTILE_ID}.html").is_file()


def test_cli_refuses_an_invalid_kb_in_one_line(tmp_path):
    team = tmp_path / "team"
    (team / "causes").mkdir(parents=True)
    (team / "causes" / "broken.yaml").write_text("id: broken\ntitle: ''\n")
    result = CliRunner().invoke(main, ["kb", "site", str(tmp_path / "out"), "--kb", str(team)])
    assert result.exit_code == 1
    assert "knowledge base is invalid" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
