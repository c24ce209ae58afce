"""The checks, one module per area; importing this package registers them all.

To add a check: write a function `Script -> Iterator[Finding]` in the module
of its area (or a new module listed below), decorate it with
`@check("<cause id from data/causes.yaml>")`, and add a fixture named for
the mistake under tests/data/scripts/ with `# expect: <cause id>` on the
lines it must report.

- launch: the main guard, the local rank (flag or env), hard-coded world size;
- devices: fixed GPUs, set_device order, DDP device_ids on a CPU module;
- process_group: torch.distributed calls before init_process_group;
- collective_reach: collectives only some ranks reach (collective-mismatch);
- collective_args: collectives every rank calls with arguments that differ
  by rank (collective-mismatch too);
- backend: CPU tensors handed to NCCL collectives.
"""

from assistant.lint.checks import (
    backend,
    collective_args,
    collective_reach,
    devices,
    launch,
    process_group,
)

__all__ = [
    "backend",
    "collective_args",
    "collective_reach",
    "devices",
    "launch",
    "process_group",
]
