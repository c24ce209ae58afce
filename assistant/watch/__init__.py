"""Wrapping and watching the user's own launch (`assistant run`, and the chat's run command).

Headless: no Textual, no rich, no torch in this process. The pieces:

- jobhook: the sitecustomize put into every Python process of the job
  (records, output files, faulthandler stacks, progress, flight recorder);
- watcher: starts the launch, streams its output, detects a hang, takes
  the stacks, ends the job (LaunchReport);
- records / stacks / hang / flight: reading what the ranks left behind,
  and naming the rank that hangs;
- launch: the script, interpreter, ranks per node and environment of the
  command, so that lint and probes see what the job saw;
- retention: old run folders in the cache pruned when a run starts;
- session: run_and_diagnose(), the one call a front end makes.

A front end (the chat) does:

    from assistant.watch import RunCallbacks, RunOptions, run_and_diagnose

    outcome = run_and_diagnose(
        ["torchrun", "--nproc_per_node=2", "train.py"],
        RunOptions(hang_after=600, probe=True),
        engine,                                   # the loaded knowledge Engine
        RunCallbacks(on_output=..., on_launch=..., on_probe=..., on_result=...),
        cancel,                                   # a threading.Event: the stop key
    )
"""

from assistant.watch.session import RunCallbacks, RunOptions, RunOutcome, run_and_diagnose
from assistant.watch.watcher import RunStart

__all__ = ["RunCallbacks", "RunOptions", "RunOutcome", "RunStart", "run_and_diagnose"]
