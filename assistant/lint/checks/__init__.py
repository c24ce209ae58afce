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
- rank_dependent: collectives every rank calls, but with tensors whose
  shape or dtype depends on the rank (collective-mismatch too), or in a
  loop whose number of iterations does (uneven-inputs);
- backend: CPU tensors handed to NCCL collectives;
- data: a DataLoader with no DistributedSampler in a DDP script
  (missing-distributed-sampler), a DistributedSampler whose set_epoch is
  never called in the epoch loop (sampler-set-epoch);
- checkpoint: torch.save of the same file on every rank
  (checkpoint-written-by-every-rank);
- cache: a dataset downloaded with `download=True` by every rank at once
  into the same folder (dataset-cache-race);
- model_build: layers added or resized on some ranks only before DDP wraps
  the model (model-differs-across-ranks);
- wrapper: the model's own methods and fields read through the DDP /
  DataParallel wrapper instead of `.module` (ddp-wrapper-attribute).
"""

from assistant.lint.checks import (
    backend,
    cache,
    checkpoint,
    collective_reach,
    data,
    devices,
    launch,
    model_build,
    process_group,
    rank_dependent,
    wrapper,
)

__all__ = [
    "backend",
    "cache",
    "checkpoint",
    "collective_reach",
    "data",
    "devices",
    "launch",
    "model_build",
    "process_group",
    "rank_dependent",
    "wrapper",
]
