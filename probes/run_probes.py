"""Run several probes in one torchrun launch: what `assistant doctor` starts.

    torchrun --nproc_per_node=2 probes/run_probes.py [--out DIR] [NAME ...]

Without names it runs every probe, in probe_protocol.PROBE_ORDER, in the
same processes: one torch import and one process group for all of them.
Probes that touch no process group come first, so a rendezvous problem
cannot hide their facts; `backend` comes last because it sets the CUDA device.
set_device_order only checks CUDA and NCCL here: its variants each need a
launch of their own (see probes/set_device_order.py).

If it hangs: the facts written so far are in --out; the last record with
status "running" names the probe (and often the step) that hangs. Run that
probe on its own as its docstring says.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from _probekit import FACTS_DIR_ENV, Rank, describe, finish, run_probe, say
from probe_protocol import PROBE_ORDER as ORDER


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run several probes in one launch.")
    parser.add_argument("--out", help="folder for the JSON facts (default: PROBE_FACTS_DIR)")
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(ORDER))
    options = parser.parse_args(argv)
    unknown = sorted(set(options.names) - set(ORDER))
    if unknown:
        parser.error(f"unknown probe(s): {', '.join(unknown)}")
    names = [name for name in ORDER if name in (options.names or ORDER)]
    out = options.out or os.environ.get(FACTS_DIR_ENV)
    out_dir = Path(out) if out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    import torch  # noqa: F401  (once, before the clocks of the probes start)

    rank = Rank.from_env()
    success, hard_exit = True, False
    for name in names:
        record, ctx = run_probe(importlib.import_module(name), rank, out_dir)
        say(rank, describe(record))
        success = success and record["status"] in ("ok", "not_applicable")
        hard_exit = hard_exit or ctx.hard_exit
    return finish(success, hard_exit)


if __name__ == "__main__":
    sys.exit(main())
