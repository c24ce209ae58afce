"""`assistant feedback` (a user's word on an answer) and `assistant kb feedback` (for KB teams)."""

from __future__ import annotations

import json
from pathlib import Path

import click


def _store():
    from assistant.config import feedback_path
    from assistant.feedback import FeedbackStore

    return FeedbackStore(feedback_path())


@click.command()
@click.argument("answer_id")
@click.option("--cause", "cause_id", required=True, help="The cause id you are speaking of.")
@click.option("--fixed", "verdict", flag_value="fixed", help="Its fix solved the problem.")
@click.option("--wrong", "verdict", flag_value="wrong", help="It was not the cause.")
@click.option("--note", default="", help="A few words to keep with it.")
def feedback(answer_id, cause_id, verdict, note):
    """Say that a cause of an answer fixed it, or was wrong (kept on this machine only).

    \b
    assistant feedback 3f2a9c01d4e5 --cause duplicate-gpu-per-rank --fixed
    assistant feedback 3f2a9c01d4e5 --cause set-device-order --wrong --note "GPU was fine"
    """
    from assistant.errors import UserError

    if verdict is None:
        raise UserError("say --fixed or --wrong")
    _store().record(answer_id, cause_id, verdict, note)
    click.echo(f"recorded: {cause_id} {verdict} for answer {answer_id}")


@click.command("feedback")
@click.option(
    "--export",
    "export_to",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the confirmed cases as eval lines ({id, query, causes}) to a new file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def kb_feedback(export_to, as_json):
    """What users said, per cause; --export turns confirmed cases into an eval set.

    \b
    assistant kb feedback
    assistant kb feedback --export confirmed.jsonl && assistant kb eval confirmed.jsonl
    """
    store = _store()
    if export_to is not None:
        count = store.export(export_to)
        click.echo(f"wrote {count} confirmed case(s) to {export_to}")
        return
    rows = store.summary()
    if as_json:
        click.echo(json.dumps([row.__dict__ for row in rows], indent=2))
        return
    if not rows:
        click.echo("no feedback recorded yet (assistant feedback ANSWER_ID --cause ID --fixed)")
    for row in rows:
        click.echo(f"{row.cause_id:34} fixed={row.fixed:<4} wrong={row.wrong}")
