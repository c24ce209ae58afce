"""`assistant explain ID`: one cause's document in the terminal (as `ruff rule` shows a rule).

Reads the KB files only (no index, no model), so it answers at once.
"""

from __future__ import annotations

import difflib
import json
import os

import click

from assistant.cli.options import team_kb_option
from assistant.errors import UserError
from assistant.i18n import translate

# The document's own section names; the shared ones (why, fix, risks, answers,
# references) are i18n.STRINGS, which `word` falls back to.
EXPLAIN_WORDS: dict[str, dict[str, str]] = {
    "explain.error_text": {"en": "The error, as it appears", "zh": "报错原文（匹配规则）"},
    "explain.symptoms": {"en": "How people report it", "zh": "用户的描述"},
    "explain.probes": {"en": "Probes that decide it here", "zh": "可在本机判断的探针"},
    "explain.no_probe": {
        "en": "none: only the error text or your script can decide it",
        "zh": "无：只能由报错文本或你的脚本判断",
    },
}


def word(key: str, lang: str) -> str:
    """A section name of the document in `lang`: this module's own, else a shared one."""
    return translate(EXPLAIN_WORDS, key, lang)


def user_lang() -> str:
    """zh when the terminal's locale is Chinese, else en."""
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(name, "")
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


@click.command()
@click.argument("cause_id")
@click.option("--lang", type=click.Choice(["en", "zh"]), help="Language (default: your locale).")
@click.option("--json", "as_json", is_flag=True, help="Print the document as JSON.")
@team_kb_option
def explain(cause_id, lang, as_json):
    """Show a cause's document: why, the error text, the fix, its probes, the community answers.

    \b
    assistant explain duplicate-gpu-per-rank
    assistant explain set-device-order --lang zh
    """
    from assistant.config import kb_layers
    from assistant.knowledge.kb import load_valid_kb

    knowledge = load_valid_kb(kb_layers(), require_contract=False)
    cause = knowledge.causes.get(cause_id)
    if cause is None:
        raise UserError(unknown_cause(cause_id, list(knowledge.causes)))
    from assistant.knowledge.catalog import claiming_answers
    from assistant.results import CauseDoc

    doc = CauseDoc.from_kb(cause.model_dump())
    # All of them, in the KB's order: this is the cause's reference page, not a ranking.
    threads = [thread.model_dump() for thread in knowledge.threads]
    answers = claiming_answers(threads, cause_id, order="kb")
    lang = lang or user_lang()
    if as_json:
        payload = {**doc.__dict__, "answers": [a.to_json() | {"note": a.note} for a in answers]}
        click.echo(json.dumps(payload, ensure_ascii=False, indent=2, default=list))
        return
    from rich.console import Console

    print_document(doc, answers, lang, Console(soft_wrap=False))


def unknown_cause(cause_id: str, known: list[str]) -> str:
    """The one-line error for an unknown id, with the nearest ids."""
    near = difflib.get_close_matches(cause_id, known, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(near)}?" if near else "; `assistant kb stats` lists them"
    return f"unknown cause {cause_id!r}{hint}"


def print_document(doc, answers, lang: str, console) -> None:
    """The document in fixed sections, like a lint rule's page."""
    from rich.markdown import Markdown
    from rich.syntax import Syntax
    from rich.text import Text

    from assistant.cli.render import answer_lines
    from assistant.probing.registry import PROBES

    console.print(Text(f"{doc.text('title', lang)}  [{doc.id}]", style="bold"))
    console.print(doc.text("summary", lang))
    section = lambda key: console.print(Text(f"\n{word(key, lang)}", style="bold"))
    section("why")
    console.print(Markdown(doc.text("why", lang)))
    section("explain.error_text")
    for pattern in doc.signatures:
        console.print(Text(f"  {pattern}", style="cyan"))
    section("explain.symptoms")
    for symptom in doc.symptoms:
        console.print(f"  • {' '.join(symptom.split())[:200]}")
    section("fix")
    console.print(Markdown(doc.text("fix", lang)))
    console.print(Syntax(doc.fix_code.rstrip(), "python", theme="ansi_dark", word_wrap=True))
    section("risks")
    console.print(Markdown(doc.risks))
    section("explain.probes")
    for name in doc.probes:
        question = PROBES[name].question if name in PROBES else ""
        console.print(f"  • {name}: {question}")
    if not doc.probes:
        console.print(f"  {word('explain.no_probe', lang)}")
    if answers:
        section("answers")
        for answer in answers:
            for line in answer_lines(answer, lang):
                console.print(line)
    section("references")
    for title, url in doc.references:
        console.print(f"  • {title}: {url}")
