"""Which launch variables does each rank see, and do they agree?

Run by hand (standard library and torch only; copy the probes/ folder):

    torchrun --nproc_per_node=2 probes/launch_env.py

Each rank prints the env:// variables torchrun gave it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the ones that
are missing. `python probes/launch_env.py` shows what a plain python start
gets: all of them missing.

If it hangs: this probe runs no collective, so a hang means torchrun could
not start its workers. Try `torchrun --standalone --nproc_per_node=2 ...`
and check that nothing else holds the rendezvous port.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys

from _probekit import USER_PREFIX, main, under_runner
from probe_protocol import NPROC_SOURCE_ENV

NAME = "launch_env"

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ELASTIC_VARS = (
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "OMP_NUM_THREADS",
)
# Variables that say the job spans several nodes, whoever launched it.
MULTI_NODE_VARS = (
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "PET_NNODES",
    "NNODES",
    "NODE_RANK",
    "GROUP_WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


def collect(ctx) -> dict:
    """The launch variables of this rank, the user's own values, and hints."""
    env = {name: os.environ.get(name) for name in LAUNCH_VARS + ELASTIC_VARS}
    missing = [name for name in LAUNCH_VARS if not os.environ.get(name)]
    facts = {
        "env": env,
        "missing": missing,
        "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
        # torchrun passes no --local-rank argument; torch.distributed.launch does.
        "local_rank_args": [
            a for a in sys.argv[1:] if a.startswith(("--local-rank", "--local_rank"))
        ],
        "user_env": _user_launch_env(),
        "nproc_source": os.environ.get(NPROC_SOURCE_ENV),
        "multi_node_hints": {k: os.environ[k] for k in MULTI_NODE_VARS if os.environ.get(k)},
        # The first method is the platform default: fork on Linux before
        # Python 3.14, spawn on macOS and Windows.
        "default_start_method": multiprocessing.get_all_start_methods()[0],
        "python": sys.executable,
        "python_version": platform.python_version(),
        "platform": sys.platform,
    }
    problems = []
    if missing:
        problems.append(f"not started by torchrun: {', '.join(missing)} not set")
    facts["problems"] = problems
    facts["summary"] = (
        f"RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} WORLD_SIZE={env['WORLD_SIZE']} "
        f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']} MASTER={env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    )
    return facts


def _user_launch_env() -> dict | None:
    """The user's own launcher variables, as the runner handed them over.

    None when run by hand: then the launch itself is the user's.
    """
    if not under_runner():
        return None
    return {
        key[len(USER_PREFIX) :]: value
        for key, value in sorted(os.environ.items())
        if key.startswith(USER_PREFIX)
    }


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
