"""Record the facts of two real nodes runs for tests/fixtures/facts/nodes/.

    python tests/multinode/record_nodes_facts.py healthy_2      # one shared folder
    python tests/multinode/record_nodes_facts.py local_disk_2   # node 1's folder private

Two processes on this machine, each running the nodes probe through torchrun
as `assistant doctor --nnodes 2 --nodes-only` does (NodesRunner.run_nodes),
over 127.0.0.1. For local_disk_2 node 1 runs in a mount namespace of its own
with a tmpfs over the checked folder (`unshare --mount`, root only): the same
path, another disk, as a folder on a second machine's local disk. Node 0's
view is saved. Not a test (no test_ prefix): run it by hand to re-record.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "nodes"
SCENARIOS = {
    "healthy_2": "two doctor agents (node ranks 0 and 1) on one CPU machine over 127.0.0.1, "
    "checking one shared folder",
    "local_disk_2": "two doctor agents on one CPU machine over 127.0.0.1; node 1 in a mount "
    "namespace of its own with a tmpfs over the checked folder (a folder on its own disk)",
}
NODE = """
import sys
from pathlib import Path
from assistant.probing.multinode import NodesRunner, plan_from_options
from assistant.probing.recorded import save_runs
from assistant.probing.runner import ProbeRunner

rank, port, folder, out, scenario, description = sys.argv[1:7]
plan = plan_from_options({}, nnodes=2, node_rank=int(rank), master_addr="127.0.0.1",
                         master_port=int(port), join_timeout=30.0, nproc_per_node=2,
                         storage_dir=folder)
run = NodesRunner(ProbeRunner(nproc_per_node=2), plan, local=False).run_nodes()
if rank == "0":
    save_runs(Path(out), [run], scenario=scenario, description=description)
print(run.status, run.detail)
"""


def main(scenario: str) -> None:
    from assistant.probing.machine import free_port

    port = str(free_port())
    out = FIXTURES / f"{scenario}.json"
    description = f"Recorded: {SCENARIOS[scenario]}, torch 2.13 CPU; node 0's view"
    with tempfile.TemporaryDirectory() as folder:
        commands = []
        for rank in ("0", "1"):
            command = [sys.executable, "-c", NODE, rank, port, folder, str(out),
                       f"nodes_{scenario}", description]  # fmt: skip
            if rank == "1" and scenario == "local_disk_2":
                mount = 'mount -t tmpfs none "$0" && exec "$@"'
                command = ["unshare", "--mount", "--propagation", "private",
                           "sh", "-c", mount, folder, *command]  # fmt: skip
            commands.append(command)
        agents = [subprocess.Popen(c, cwd=Path(__file__).resolve().parents[2]) for c in commands]
        for agent in agents:
            agent.wait(timeout=240)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
