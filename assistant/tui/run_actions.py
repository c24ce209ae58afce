"""The palette's "Run a launch command" and the feedback keys, on the chat.

A mixin of ChatApp (assistant.tui.app): it uses the app's `deps`, `tell`,
`add_turn`, `views`, `runs` and `save`. The launch goes through
deps.launcher (assistant.watch.run_and_diagnose over the chat's engine
thread); feedback goes to deps.answers (assistant.feedback.FeedbackStore).
"""

from __future__ import annotations

import dataclasses
import shlex
import threading

from textual import work

from assistant.chat.conversation import Turn
from assistant.errors import UserError
from assistant.tui.messages import (
    FeedbackGiven,
    Notice,
    RunDiagnosed,
    RunEnded,
    RunOutput,
    TurnFailed,
)
from assistant.tui.present import one_line, seconds
from assistant.tui.screens import PathPrompt
from assistant.tui.strings import tr

RUN_PLACEHOLDER = "torchrun --nproc_per_node=2 train.py"


def split_command(line: str) -> list[str]:
    """A typed command line as argv, split like a shell would but never run by one."""
    try:
        command = shlex.split(line)
    except ValueError as exc:  # an unclosed quote
        raise UserError(f"cannot read the command: {exc}") from None
    if not command:
        raise UserError("the command is empty")
    return command


class RunActions:
    """Run a launch command in a turn, and record feedback on a cause."""

    run_cancel: threading.Event | None = None  # the watched job, if one runs

    # run

    def action_run_command(self) -> None:
        prompt = PathPrompt(
            self.lang,
            "run.prompt",
            placeholder=RUN_PLACEHOLDER,
            hint_key="run.prompt_hint",
            empty_key="run.empty",
        )
        self.push_screen(prompt, callback=self.run_command_line)

    async def run_command_line(self, line: str | None) -> None:
        if not line:
            return
        try:
            command = split_command(line)
        except UserError as exc:
            self.tell(str(exc), severity="error")
            return
        if self.run_cancel is not None:
            self.run_cancel.set()  # one watched job at a time: the new run ends the old one
        self.run_cancel = threading.Event()
        turn = Turn(query="$ " + shlex.join(command), lang=self.lang, created=self.deps.now())
        view = await self.add_turn(turn)
        view.start_job()
        self.watch_launch(view.key, command, self.run_cancel)

    @work(thread=True, group="run", exit_on_error=False)
    def watch_launch(self, key: int, command: list[str], cancel: threading.Event) -> None:
        """The launch, watched and answered for (deps.launcher), reporting as it goes."""
        from assistant.watch import RunCallbacks  # not imported before the first run

        callbacks = RunCallbacks(
            on_start=self.tell_pruning_problem,
            on_output=lambda stream, data: self.post_message(RunOutput(key, stream, data)),
            on_launch=lambda launch: self.post_message(RunEnded(key, launch)),
            on_probe=self.observer(key).on_probe,
        )
        try:
            with self.runs.track(cancel):
                outcome = self.keep_answer(self.deps.launcher.run(command, callbacks, cancel))
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(TurnFailed(key, one_line(exc)))
        else:
            self.post_message(RunDiagnosed(key, outcome))

    def tell_pruning_problem(self, start) -> None:
        """Old run logs that could not be pruned (or a bad retention setting): one notice,
        as `assistant run` prints one line; the run goes on either way."""
        if start.pruned.problem:
            self.post_message(Notice(start.pruned.problem, "warning"))

    def keep_answer(self, outcome):
        """Give the run's answer an answer_id, as the chat's own answers get (for feedback)."""
        result = outcome.result
        if self.deps.answers is None or result is None or not result.query or result.answer_id:
            return outcome
        handle = self.deps.answers.remember(result.query, [cause.id for cause in result.causes])
        return dataclasses.replace(outcome, result=dataclasses.replace(result, answer_id=handle))

    def on_run_output(self, message: RunOutput) -> None:
        view = self.views.get(message.turn)
        if view is not None:
            view.job_output(message.data)

    def on_run_ended(self, message: RunEnded) -> None:
        view = self.views.get(message.turn)
        if view is None:
            return
        launch = message.launch
        lines = [rank.summary() for rank in launch.ranks]
        if launch.hang is not None:
            lines.insert(0, tr("run.hung", view.lang, summary=launch.hang.summary))
        lines.append(tr("run.logs", view.lang, path=launch.log_dir))
        view.job_ended(lines, launch.seconds, diagnosing=launch.failed)

    async def on_run_diagnosed(self, message: RunDiagnosed) -> None:
        view = self.views.get(message.turn)
        if view is None:
            return
        launch, result = message.outcome.launch, message.outcome.result
        if result is None:
            key = "run.cancelled" if launch.cancelled else "run.finished"
            note = tr(key, view.lang, code=launch.exit_code, seconds=seconds(launch.seconds))
            view.job_note(note, succeeded=not launch.failed and not launch.cancelled)
        else:
            for run in result.probes:
                view.probe_finished(run)
            view.finish_rows("interrupted")
            await view.show_result(result, message.outcome.findings)
            view.set_phase("done")
            self.bring_into_view(view)
        self.save()

    # feedback

    def on_feedback_given(self, message: FeedbackGiven) -> None:
        if self.deps.answers is None:
            self.tell(tr("feedback.off", self.lang), severity="warning")
        elif not message.answer_id:
            self.tell(tr("feedback.not_kept", self.lang), severity="warning")
        else:
            self.record_feedback(message.answer_id, message.cause_id, message.verdict)

    @work(thread=True, group="feedback", exit_on_error=False)
    def record_feedback(self, answer_id: str, cause_id: str, verdict: str) -> None:
        """One person's word on one cause, into the local answers log (SQLite)."""
        try:
            self.deps.answers.record(answer_id, cause_id, verdict)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(
                Notice(tr("feedback.failed", self.lang, error=one_line(exc)), "error")
            )
        else:
            key = f"feedback.{verdict}"
            self.post_message(Notice(tr(key, self.lang, cause=cause_id, answer=answer_id)))
