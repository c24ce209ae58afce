"""Record probe facts on a GPU machine for tests/fixtures/facts/ (see record_facts.sh).

    PYTHONPATH=. python3 tests/gpu/record_facts.py record --scenario NAME --nproc N --out FILE
    PYTHONPATH=. python3 tests/gpu/record_facts.py summary FILE... --expect NAME:cause=verdict

Uses only the standard-library parts of the assistant (runner, verdicts), so
it runs where pydantic, faiss and textual are missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from assistant.config import contract_ids
from assistant.probing.recorded import load_runs, save_runs
from assistant.probing.registry import probe_names
from assistant.probing.runner import ProbeRunner
from assistant.verdicts import judge


def record(options: argparse.Namespace) -> int:
    """Run the probes of one scenario and save their facts."""
    env = {"CUDA_VISIBLE_DEVICES": options.visible} if options.visible is not None else None
    runner = ProbeRunner(
        nproc_per_node=options.nproc,
        timeout=options.timeout,
        env=env,
        probe_timeout=options.probe_timeout,
    )
    names = options.names or probe_names()
    started = time.monotonic()

    def show(event) -> None:
        print(
            f"  {event.elapsed:6.1f}s {event.probe} {event.state} {event.status or ''}", flush=True
        )

    runs = runner.run(names, on_progress=show)
    save_runs(Path(options.out), runs, scenario=options.scenario, description=options.description)
    print(f"  {options.scenario}: {time.monotonic() - started:.1f} s -> {options.out}")
    for run in runs:
        print(f"    {run.name:17} {run.status:15} {run.seconds:6.2f}s  {run.detail[:160]}")
    return 0


def summary(options: argparse.Namespace) -> int:
    """Print every cause's verdict per scenario and check the expected ones."""
    expected = {}
    for item in options.expect or []:
        scenario, _, rest = item.partition(":")
        cause, _, verdict = rest.partition("=")
        expected[(scenario, cause)] = verdict
    failures = 0
    for path in map(Path, options.files):
        if not path.exists():
            print(f"== {path.name}: missing (its step failed or timed out)")
            failures += sum(1 for (scenario, _) in expected if scenario == path.stem)
            continue
        runs = {run.name: run for run in load_runs(path)}
        print(f"== {path.name}")
        for run in runs.values():
            print(f"  probe {run.name:17} {run.status:15} {run.detail[:200]}")
        for cause in contract_ids():
            verdict = judge(cause, runs, None, [])
            want = expected.get((path.stem, cause))
            mark = (
                ""
                if want is None
                else (" [ok]" if verdict.verdict == want else f" [EXPECTED {want}]")
            )
            failures += bool(want and verdict.verdict != want)
            if verdict.verdict != "not_run":
                print(f"  {verdict.verdict:15} {cause}{mark}: {' | '.join(verdict.evidence)[:300]}")
    print("all expectations met" if not failures else f"{failures} expectation(s) not met")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--scenario", required=True)
    rec.add_argument("--description", default="")
    rec.add_argument("--nproc", type=int, required=True)
    rec.add_argument("--visible", help="CUDA_VISIBLE_DEVICES for the launch")
    rec.add_argument("--names", nargs="*", help="probes (default: all)")
    rec.add_argument("--timeout", type=float, default=60.0, help="seconds per torchrun launch")
    rec.add_argument("--probe-timeout", type=float, default=None, help="cap on each probe's budget")
    rec.add_argument("--out", required=True)
    summ = commands.add_parser("summary")
    summ.add_argument("files", nargs="+")
    summ.add_argument("--expect", nargs="*", help="scenario:cause=verdict")
    options = parser.parse_args(argv)
    return record(options) if options.command == "record" else summary(options)


if __name__ == "__main__":
    sys.exit(main())
