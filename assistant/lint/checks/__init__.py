"""The checks, one module per area; importing this package registers them all.

To add a check: write a function `Script -> Iterator[Finding]` in the module
of its area (or a new module listed below), decorate it with
`@check("<cause id from data/causes.yaml>")`, and add a fixture named for
the mistake under tests/data/scripts/ with `# expect: <cause id>` on the
lines it must report.

- launch: the main guard, the local rank (flag or env), hard-coded world size,
  a spawned worker's per-process rank beside a world size of nodes, a device
  mesh sized from one node's processes in a job of several nodes;
- devices: fixed GPUs (also a library's `device_id=0`), set_device order, DDP
  device_ids on a CPU module;
- process_group: torch.distributed calls before init_process_group;
- collective_reach: collectives only some ranks reach (collective-mismatch;
  the DDP wrapper's forward, which broadcasts BatchNorm buffers, counts),
  also under a test of the rank's own tensor values (`if loss.mean() > t:`),
  and a step one rank skips on its own data (a NaN loss, an empty batch, a
  batch that ran out of GPU memory) before its backward's gradient all-reduce
  (uneven-inputs); a new_group of the members this rank decides, outside a loop
  over every group (collective-mismatch); a skip taken when this rank's own share
  is empty (`if not mine: continue`) ahead of collectives (collective-mismatch);
- collective_saves: checkpoint calls that are collectives (DeepSpeed's
  engine.save_checkpoint, Lightning's trainer.save_checkpoint, Fabric's save,
  FSDP's state_dict, ZeroRedundancyOptimizer's consolidate_state_dict) under a
  rank test (collective-mismatch, fsdp-state-dict);
- rank_dependent: collectives every rank calls, but with tensors whose
  shape or dtype depends on the rank (collective-mismatch too), or in a
  loop whose number of iterations does (uneven-inputs);
- backend: CPU tensors handed to NCCL collectives; NCCL chosen in a file that
  also runs on an accelerator NCCL does not serve (xpu, npu, mps, hpu)
  (nccl-not-available);
- batching: a batch sampler that shards the samples by rank, then batches
  each rank's share by length or bucket on its own (uneven-inputs);
- batchnorm: a DDP model with BatchNorm called twice before one backward while
  DDP broadcasts buffers at each forward (ddp-broadcast-buffers-inplace), and
  plain BatchNorm over a per-GPU batch of a few samples (batchnorm-not-synced),
  and SyncBatchNorm in a run on the CPU over gloo (syncbn-without-process-group);
- data: a DataLoader with no DistributedSampler in a DDP script
  (missing-distributed-sampler), a DistributedSampler whose set_epoch is
  never called in the epoch loop (sampler-set-epoch);
- checkpoint: torch.save of the same file on every rank
  (checkpoint-written-by-every-rank), a checkpoint every rank loads with no
  map_location (checkpoint-map-location);
- state_dict: the DDP wrapper's state_dict loaded into a model not wrapped
  there (state-dict-module-prefix);
- cache: a dataset downloaded with `download=True` by every rank at once
  into the same folder, or a cache file built when missing by every rank
  (dataset-cache-race);
- gather_sizes: all_gather of a tensor whose row count the rank's data
  decides (detections, a mask's selection) into buffers shaped like the
  local one (collective-mismatch);
- metrics: an evaluation loop over each rank's share of the data whose
  totals are shown or compared without a collective, an evaluation function
  handed the model and a count divided by the number of processes, or a
  LightningModule's epoch-end metric from the outputs its steps collected,
  logged unsynced (metrics-not-reduced);
- model_build: layers added or resized on some ranks only before DDP wraps
  the model, sized from data each rank reads for itself, or sized by the
  rank itself inside the wrapped module (a class-sharded head)
  (model-differs-across-ranks);
- wrapper: the model's own methods and fields read through the DDP /
  DataParallel wrapper instead of `.module` (ddp-wrapper-attribute);
- dataparallel: a model whose forward returns its scalar loss, run through
  nn.DataParallel, with backward() straight on the gathered vector
  (dataparallel-unsafe-model);
- deepspeed_config: a DeepSpeed config dict in the file whose batch size or
  accumulation contradicts the Trainer's arguments (deepspeed-config-mismatch);
- schedules: a learning-rate schedule whose length counts the whole dataset's
  steps while each process reads a share (effective-batch-size-changed);
- spawn: mp.spawn's args that is not a tuple, or does not fit the worker's
  parameters after the process index, and a worker called instead of
  passed (mp-spawn-arguments);
- reentrant: reentrant activation checkpointing under DDP with
  find_unused_parameters=True, or of one module several times per forward
  (ddp-reentrant-checkpoint);
- logger: wandb.init or a TensorBoard SummaryWriter on every rank, or
  wandb.log on every rank after an init on rank 0 only (experiment-logger-ddp);
- zero: the engine's state_dict read under DeepSpeed ZeRO stage 3, outside
  GatheredParameters, and torch.nn.utils.clip_grad_norm_ over FSDP's shards
  (zero3-partitioned-parameters);
- compile_prefix: a torch.compile'd model's checkpoint ("_orig_mod." keys)
  loaded strictly into a model that is not compiled (torch-compile-ddp);
- endpoint: MASTER_ADDR set to each process's own host name in a file that
  shows several nodes, and MASTER_PORT chosen in each process mp.spawn starts
  (master-endpoint-mismatch);
- fork: a Dataset's item reader or a collate_fn that moves data to the GPU
  inside DataLoader workers forked after CUDA started, or the target of a
  process the script forks itself after CUDA started (cuda-init-before-fork);
- unused: a submodule forward skips when an optional input is None, called
  with None in training under a DDP that expects every parameter
  (unused-parameters);
- node_local: rank 0 saving a checkpoint into a folder on its own node
  ($SLURM_TMPDIR, /tmp, a local NVMe) that every rank loads back, in a job
  the file launches on several nodes (checkpoint-on-node-local-disk);
- rollouts: a backward per minibatch of an RL rollout each rank collects
  until its own episodes end, so ranks run different numbers of steps
  (uneven-inputs);
- resume: one checkpoint file per rank, saved and loaded by rank number, under
  a launch whose node count may change between restarts (`--nnodes=2:8`)
  (resume-different-world-size);
- timeouts: rank 0 walking data alone (an evaluation) while the others wait
  in the next collective, under a process-group timeout shortened below
  NCCL's default (collective-timeout);
- unread_layers: a layer the wrapped model builds with parameters that nothing
  in the file reads (a learned position table left after a switch to rotary
  positions; unused-parameters);
- unused_paths: a training call whose own arguments (constants, defaults, a
  flag or mode decided per step, by a counter or by the step's batch) route
  forward around a submodule (unused-parameters);
- weighted_heads: a LightningModule's head that only a loss weight with a
  default of 0 runs, under strategy="ddp" (unused-parameters);
- seen_keys: a collective over one row per key (class, speaker) that the
  rank's own data filled into a dict (collective-mismatch);
- clock_stops: a training loop each rank leaves by its own clock (a time
  budget no rank shares; uneven-inputs);
- own_launcher: workers the file starts itself (multiprocessing, spawn, Popen)
  with RANK and WORLD_SIZE but no MASTER_ADDR / MASTER_PORT, joined over
  env:// (launched-without-torchrun); one GPU per worker through
  CUDA_VISIBLE_DEVICES, then the device picked by rank
  (cuda-visible-devices-mismatch);
- precision: a model cast to float16 whose optimizer a GradScaler steps, and
  float16 autocast / FSDP MixedPrecision with no loss scaler
  (mixed-precision-dtype);
- splits: a random split every rank draws unseeded (or seeded with its rank),
  and a set of class names numbered in its iteration order
  (rank-divergent-data-split);
- vocabulary: a tokenizer of the file whose special ids lie past the
  vocabulary size it reports (device-side-assert).
"""

from assistant.lint.checks import (
    backend,
    batching,
    batchnorm,
    cache,
    checkpoint,
    clock_stops,
    collective_reach,
    collective_saves,
    compile_prefix,
    data,
    dataparallel,
    deepspeed_config,
    devices,
    endpoint,
    fork,
    gather_sizes,
    launch,
    logger,
    metrics,
    model_build,
    node_local,
    own_launcher,
    precision,
    process_group,
    rank_dependent,
    reentrant,
    resume,
    rollouts,
    schedules,
    seen_keys,
    spawn,
    splits,
    state_dict,
    timeouts,
    unread_layers,
    unused,
    unused_paths,
    vocabulary,
    weighted_heads,
    wrapper,
    zero,
)

__all__ = [
    "backend",
    "batching",
    "batchnorm",
    "cache",
    "checkpoint",
    "clock_stops",
    "collective_reach",
    "collective_saves",
    "compile_prefix",
    "data",
    "dataparallel",
    "deepspeed_config",
    "devices",
    "endpoint",
    "fork",
    "gather_sizes",
    "launch",
    "logger",
    "metrics",
    "model_build",
    "node_local",
    "own_launcher",
    "precision",
    "process_group",
    "rank_dependent",
    "reentrant",
    "resume",
    "rollouts",
    "schedules",
    "seen_keys",
    "spawn",
    "splits",
    "state_dict",
    "timeouts",
    "unread_layers",
    "unused",
    "unused_paths",
    "vocabulary",
    "weighted_heads",
    "wrapper",
    "zero",
]
