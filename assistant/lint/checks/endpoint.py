"""MASTER_ADDR set to each process's own host name in a multi-node job.

`os.environ["MASTER_ADDR"] = socket.gethostname()` (or a setdefault of it, or
`init_method=f"tcp://{socket.gethostname()}:29500"`) gives every node its own
master: the ranks of each node look for the store on their own machine and
never meet (a rendezvous timeout, or several one-node jobs). It is right on
one machine only, so it is reported when the file shows several nodes: a
node's index or count it reads (SLURM_NODEID, NODE_RANK; a task's SLURM_PROCID
is there on one node too), or a launch line of more than one node.
A host name sent from rank 0 to the others (MPI's `bcast`) is the master's,
not each node's own.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.model import Script, called_name, keyword, short, source_text
from assistant.lint.registry import check
from assistant.results import Finding

OWN_HOST_CALLS = frozenset({"gethostname", "getfqdn", "node"})  # socket's, platform.node()
# What says several nodes: a node's own index or count (not a task's: srun's
# SLURM_PROCID / SLURM_NTASKS are there on one node too), or a launch of 2+ nodes.
NODE_VARIABLES = re.compile(r"SLURM_(?:NODEID|NNODES)|NODE_RANK|NNODES|NUM_NODES")
SEVERAL_NODES = re.compile(r"--(?:nodes|nnodes)[= ](?:[2-9]|\d{2,})\b|\s-N\s*(?:[2-9]|\d{2,})\b")


@check("master-endpoint-mismatch")
def check_master_address_of_each_node(script: Script) -> Iterator[Finding]:
    """MASTER_ADDR (or a tcp:// init_method) made of this process's own host name."""
    if not (NODE_VARIABLES.search(script.source) or SEVERAL_NODES.search(script.source)):
        return
    for node in script.nodes:
        value = master_address_value(script, node)
        if value is not None and own_host_name(script, value):
            yield script.finding(
                "master-endpoint-mismatch",
                node,
                f"the master address is this process's own host name (`{source_text(value)}`): "
                "on several nodes each node's ranks look for the store on their own machine "
                "and never meet (a rendezvous timeout); give every node the same address, "
                "the job's first host (`scontrol show hostnames $SLURM_JOB_NODELIST | head "
                "-n1`, exported before srun) or rank 0's",
            )


def master_address_value(script: Script, node: ast.AST) -> ast.expr | None:
    """What `os.environ["MASTER_ADDR"] = v`, `os.environ.setdefault("MASTER_ADDR", v)`
    or `init_process_group(init_method=f"tcp://{v}:port")` gives the master address."""
    if isinstance(node, ast.Assign) and any(names_master(t) for t in node.targets):
        return node.value
    if not isinstance(node, ast.Call):
        return None
    if called_name(node) == "setdefault" and len(node.args) == 2 and is_master_key(node.args[0]):
        return node.args[1]
    if short(script.name_of(node.func)) == "init_process_group":
        method = keyword(node, "init_method")
        if isinstance(method, ast.JoinedStr):
            host = next((v.value for v in method.values if isinstance(v, ast.FormattedValue)), None)
            return host
    return None


def names_master(target: ast.expr) -> bool:
    """`os.environ["MASTER_ADDR"]`."""
    return isinstance(target, ast.Subscript) and is_master_key(target.slice)


def is_master_key(key: ast.expr) -> bool:
    return isinstance(key, ast.Constant) and key.value == "MASTER_ADDR"


def own_host_name(script: Script, value: ast.expr) -> bool:
    """The value is a host-name call of this process (`socket.gethostname()`,
    `gethostbyname(getfqdn())`, `str(...)` of one), directly or through the one
    value its name is given; not one another process sends (`comm.bcast(...)`)."""
    if isinstance(value, ast.Name):
        values = script.assigned_values.get(value.id, [])
        return len(values) == 1 and own_host_name(script, values[0])
    while isinstance(value, ast.Call) and called_name(value) in ("str", "gethostbyname"):
        if not value.args:
            return False
        value = value.args[0]
    return isinstance(value, ast.Call) and called_name(value) in OWN_HOST_CALLS
