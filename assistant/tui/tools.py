"""The palette's tools on the chat: doctor, lint a script, rebuild the KB, export.

A mixin of ChatApp (assistant.tui.app): it uses the app's `deps`, `tell`,
`add_turn`, `observer`, `runs` and `probe_lock`.
"""

from __future__ import annotations

from pathlib import Path

from textual import work

from assistant.chat.conversation import Turn
from assistant.chat.export import ExportFailed
from assistant.tui.messages import (
    Answered,
    LintDone,
    ModelLoaded,
    ProbesFailed,
    RebuildDone,
    Rejudged,
    TurnFailed,
)
from assistant.tui.present import one_line
from assistant.tui.screens import ExportChoice, PathPrompt
from assistant.tui.strings import tr
from assistant.tui.turn import TurnView


class ToolActions:
    """Doctor, lint, rebuild and export, as the palette and the keys start them."""

    # doctor

    async def action_doctor(self) -> None:
        turn = Turn(query="doctor", lang=self.lang, kind="doctor", created=self.deps.now())
        view = await self.add_turn(turn)
        view.set_phase("probing")
        self.run_doctor(view.key, self.lang)

    @work(thread=True, group="doctor", exit_on_error=False)
    def run_doctor(self, key: int, lang: str) -> None:
        """Every probe on this machine, every cause judged (Pipeline.doctor)."""
        try:
            with self.runs.track() as cancel, self.probe_lock:
                result = self.deps.pipeline.doctor(lang, self.observer(key), cancel)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(TurnFailed(key, one_line(exc)))
        else:
            self.post_message(Answered(key, result))

    # lint

    def action_lint(self) -> None:
        self.push_screen(PathPrompt(self.lang), callback=self.lint_path)

    async def lint_path(self, path: str | None) -> None:
        if not path:
            return
        turn = Turn(query=path, lang=self.lang, kind="lint", created=self.deps.now())
        view = await self.add_turn(turn)
        view.set_phase("linting")
        self.lint(view.key, path)

    @work(thread=True, group="lint", exit_on_error=False)
    def lint(self, key: int, path: str) -> None:
        """Lint a training script (assistant.lint)."""
        try:
            findings = list(self.deps.lint(path))
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(TurnFailed(key, one_line(exc)))
        else:
            self.post_message(LintDone(key, findings))

    def on_lint_done(self, message: LintDone) -> None:
        view = self.views.get(message.turn)
        if view is None:
            return
        view.turn.findings = list(message.findings)
        view.set_phase("done")
        self.save()
        latest = self.latest_answered()
        if latest is not None:
            self.rejudge(latest.key, latest.turn.result, self.conversation.findings())

    def latest_answered(self) -> TurnView | None:
        for view in reversed(self.turn_views):
            if view.turn.kind == "ask" and view.phase == "done" and view.turn.result:
                return view
        return None

    @work(thread=True, group="rejudge", exit_on_error=False)
    def rejudge(self, key: int, result, findings: list) -> None:
        """New findings: judge the answer again with the probe runs it already has.

        A script was just linted, so the answer no longer asks for it.
        """
        try:
            judged = self.deps.pipeline.judge(
                result, list(result.probes), findings, script_checked=True
            )
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ProbesFailed(key, one_line(exc)))
        else:
            self.post_message(Rejudged(key, judged))

    async def on_rejudged(self, message: Rejudged) -> None:
        view = self.views.get(message.turn)
        if view is not None:
            await view.show_result(message.result, self.conversation.findings())
            view.refresh_view()
            self.save()

    # rebuild

    def action_rebuild(self) -> None:
        self.status.set_state(note=tr("rebuild.started", self.lang))
        self.rebuild_kb()

    @work(group="rebuild", exit_on_error=False)
    async def rebuild_kb(self) -> None:
        """Recompile the knowledge base index and reload it."""
        try:
            summary = await self.deps.knowledge.rebuild()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(RebuildDone(error=one_line(exc)))
        else:
            self.post_message(RebuildDone(summary=summary))

    def on_rebuild_done(self, message: RebuildDone) -> None:
        self.status.set_state(note="")
        if message.error:
            self.tell(tr("rebuild.failed", self.lang, error=message.error), severity="error")
            return
        self.tell(tr("rebuild.done", self.lang, summary=message.summary))
        if self.model_phase != "ready" and self.deps.knowledge.ready:
            self.post_message(ModelLoaded())

    # export

    def action_export(self) -> None:
        if not self.conversation.turns:
            self.tell(tr("export.empty", self.lang), severity="warning")
            return
        text = self.deps.exporter.markdown(self.conversation, self.lang)
        self.export_to(text, self.deps.export_dir or Path.cwd())

    def export_to(self, text: str, target: Path) -> None:
        """Write the report; when it cannot be written, offer the other places."""
        try:
            path = self.deps.exporter.write(text, target, self.deps.now())
        except ExportFailed as failed:
            reason = tr("export.unwritable", self.lang, path=failed.path, reason=failed.reason)
            home = str(self.deps.exporter.home())
            self.push_screen(
                ExportChoice(reason, home, self.lang),
                callback=lambda choice: self.export_elsewhere(choice, text),
            )
            return
        self.copy_to_clipboard(text)
        self.last_copied = text
        self.last_export = path
        self.tell(tr("export.done", self.lang, path=path))

    def export_elsewhere(self, choice: str | None, text: str) -> None:
        home = self.deps.exporter.home()
        if choice == "home":
            self.export_to(text, home)
        elif choice == "other":
            prompt = PathPrompt(self.lang, "export.prompt", placeholder=str(home), value=str(home))
            self.push_screen(
                prompt, callback=lambda path: path and self.export_to(text, Path(path))
            )
        elif choice == "clipboard":
            self.copy_to_clipboard(text)
            self.last_copied = text
            self.tell(tr("export.copied", self.lang))
