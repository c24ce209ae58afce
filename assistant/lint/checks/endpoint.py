"""MASTER_ADDR set to each process's own host name in a multi-node job.

`os.environ["MASTER_ADDR"] = socket.gethostname()` (or a setdefault of it, or
`init_method=f"tcp://{socket.gethostname()}:29500"`) gives every node its own
master: the ranks of each node look for the store on their own machine and
never meet (a rendezvous timeout, or several one-node jobs). It is right on
one machine only, so it is reported when the file shows several nodes: a
node's index or count it reads (SLURM_NODEID, NODE_RANK; a task's SLURM_PROCID
is there on one node too), or a launch line of more than one node.
A host name sent from rank 0 to the others (MPI's `bcast`) is the master's,
not each node's own. The same for a loopback address (`localhost`,
`127.0.0.1`) where the file says, in words too, that the job spans machines
("run one copy on each PC"): a tutorial's setup() copied onto two computers.

And MASTER_PORT chosen in each process mp.spawn starts (a free port the OS
gives a socket bound to port 0, a random draw), or chosen anew for each worker a
launcher of the file starts (`env=worker_env(rank)` in the loop that starts them,
worker_env drawing a free port each call): the ranks never agree on it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.collective_reach import ancestors_in_scope
from assistant.lint.checks.fork import reached
from assistant.lint.launchtext import runs_on_several_machines
from assistant.lint.model import Script, called_name, keyword, short, source_text, walk
from assistant.lint.ranks import enclosing_scope
from assistant.lint.registry import check
from assistant.lint.torchapi import environment_settings
from assistant.results import Finding

OWN_HOST_CALLS = frozenset({"gethostname", "getfqdn", "node"})  # socket's, platform.node()
# Addresses that name the machine a process runs on, whichever machine that is.
LOOPBACK = re.compile(r"^(?:localhost|127(?:\.\d{1,3}){3}|::1)$")


@check("master-endpoint-mismatch")
def check_master_address_of_each_node(script: Script) -> Iterator[Finding]:
    """MASTER_ADDR (or a tcp:// init_method) made of this process's own host name."""
    if not runs_on_several_machines(script.source):
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


@check("master-endpoint-mismatch")
def check_loopback_master_on_several_machines(script: Script) -> Iterator[Finding]:
    """`os.environ["MASTER_ADDR"] = "localhost"` (or `tcp://127.0.0.1:port`) in a job
    the file says runs on several machines: each machine's processes look for rank
    0's store on themselves; those of the other machines never find it."""
    if not runs_on_several_machines(script.source):
        return
    for node in script.of_type((ast.Assign, ast.Call)):
        value = master_address_value(script, node)
        host = loopback_in(value) if value is not None else tcp_host(script, node)
        if host is None:
            continue
        yield script.finding(
            "master-endpoint-mismatch",
            node,
            f"the master address is `{host}`, the machine each process runs on, but this "
            "job runs on several machines: the processes of the others look for rank 0's "
            "store on themselves and never find it (init_process_group waits, then times "
            "out); give every machine rank 0's address (its LAN IP or host name), from the "
            "environment or a flag",
        )


def loopback_in(value: ast.expr) -> str | None:
    text = value.value.strip() if isinstance(value, ast.Constant) else None
    return text if isinstance(text, str) and LOOPBACK.match(text) else None


def tcp_host(script: Script, node: ast.AST) -> str | None:
    """The loopback host of `init_process_group(init_method="tcp://127.0.0.1:23456")`."""
    if not (
        isinstance(node, ast.Call) and short(script.name_of(node.func)) == "init_process_group"
    ):
        return None
    method = keyword(node, "init_method")
    if not (isinstance(method, ast.Constant) and isinstance(method.value, str)):
        return None
    found = re.match(r"tcp://\[?([^\]/]+?)\]?:\d+", method.value)
    return found.group(1) if found and LOOPBACK.match(found.group(1)) else None


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


# Launchers that run a function of the file in each process they start.
# What starts one worker process of a launcher loop.
WORKER_STARTS = frozenset({"Popen", "Process"})
PROCESS_STARTERS = frozenset(
    {"torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"}
)
RANDOM_PORTS = frozenset({"randint", "randrange", "choice"})


@check("master-endpoint-mismatch")
def check_master_port_chosen_in_each_process(script: Script) -> Iterator[Finding]:
    """`os.environ["MASTER_PORT"] = str(find_free_port())` in the function mp.spawn
    runs (or one it calls): each process picks its own port, so rank 0's store
    listens on one and the others knock on theirs, and init_process_group times
    out. A port chosen once in the parent, before the spawn, is what the children
    must share."""
    targets = [
        source_text(node.args[0] if node.args else keyword(node, "fn"))
        for node, name in script.call_names
        if name in PROCESS_STARTERS and (node.args or keyword(node, "fn") is not None)
    ]
    if not targets:
        return
    in_children = {id(function) for function in reached(script, None, targets)}
    for node in script.nodes:
        if not (isinstance(node, ast.Assign) and any(names_port(t) for t in node.targets)):
            continue
        scope = enclosing_scope(node, script)
        if scope is None or id(scope) not in in_children:
            continue
        chosen = port_choice(script, scope, node.value)
        if chosen is None:
            continue
        yield script.finding(
            "master-endpoint-mismatch",
            node,
            f"MASTER_PORT is chosen in each spawned process (`{source_text(chosen)}`): every "
            "rank picks its own port, so rank 0's store listens on one while the others "
            "connect to theirs, and init_process_group times out; choose the port once in "
            "the parent before mp.spawn and pass it (or set it there in os.environ)",
        )


@check("master-endpoint-mismatch")
def check_master_port_chosen_per_worker(script: Script) -> Iterator[Finding]:
    """`env = dict(os.environ, MASTER_PORT=str(find_free_port()), RANK=str(r))` for each
    worker a launcher loop starts (in the loop, or in a function the loop calls once
    per worker): every worker is told another port."""
    per_worker = {id(loop): loop for loop in loops_starting_workers(script)}
    if not per_worker:
        return
    calling_loops = function_calls_in_loops(script, per_worker.values())
    for where, value in environment_settings(script, "MASTER_PORT"):
        scope = enclosing_scope(where, script)
        if scope is None:
            continue
        chosen = port_choice(script, scope, value)
        if chosen is None:
            continue
        # where the port is drawn, not where it is written: a port drawn once before the
        # loop and written into each worker's environment is the same for all
        drawn_in = enclosing_scope(chosen, script)
        loop = inside_one_of(script, chosen, per_worker) or calling_loops.get(
            getattr(drawn_in, "name", None)
        )
        if loop is None:
            continue
        yield script.finding(
            "master-endpoint-mismatch",
            value,
            f"MASTER_PORT is chosen anew for each worker (`{source_text(chosen)}`, once per "
            f"pass of the loop on line {loop.lineno} that starts them): every worker is told "
            "another port, so rank 0's store listens on one while the others connect to "
            "theirs, and init_process_group times out; choose the port once, before the "
            "loop, and give every worker that one",
        )


def loops_starting_workers(script: Script) -> Iterator[ast.For]:
    """Loops whose body starts a process (`subprocess.Popen`, `Process(...)`)."""
    for node in script.of_type(ast.For):
        if any(
            isinstance(n, ast.Call) and called_name(n) in WORKER_STARTS
            for statement in node.body
            for n in walk(statement)
        ):
            yield node


def function_calls_in_loops(script: Script, loops) -> dict[str, ast.For]:
    """The file's functions called in these loops' bodies, to the innermost loop."""
    called: dict[str, ast.For] = {}
    for loop in sorted(loops, key=lambda loop: -loop.lineno):  # nested loops start later
        for statement in loop.body:
            for node in walk(statement):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in script.functions
                ):
                    called.setdefault(node.func.id, loop)
    return called


def inside_one_of(script: Script, node: ast.AST, loops: dict[int, ast.For]) -> ast.For | None:
    """The innermost of `loops` around `node` in its own function."""
    return next((loops[id(a)] for a in ancestors_in_scope(script, node) if id(a) in loops), None)


def names_port(target: ast.expr) -> bool:
    return (
        isinstance(target, ast.Subscript)
        and isinstance(target.slice, ast.Constant)
        and target.slice.value == "MASTER_PORT"
    )


def port_choice(script: Script, scope: ast.AST, value: ast.expr, hops: int = 2) -> ast.Call | None:
    """The call that picks a port anew each time: the file's function that binds a
    socket to port 0 (a free-port finder), or a random draw; through str() / int()
    and a name the same function assigns once (a parameter is the port the parent
    chose and passed: the same in every child)."""
    while isinstance(value, ast.Call) and called_name(value) in ("str", "int") and value.args:
        value = value.args[0]
    if isinstance(value, ast.Name) and hops > 0:
        values = [
            node.value
            for node in script.scope_nodes(scope)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)
        ]
        return port_choice(script, scope, values[0], hops - 1) if len(values) == 1 else None
    if not isinstance(value, ast.Call):
        return None
    if called_name(value) in RANDOM_PORTS:
        return value
    function = script.functions.get(called_name(value))
    if function is not None and binds_port_zero(function):
        return value
    return None


def binds_port_zero(function: ast.AST) -> bool:
    """`s.bind(("", 0))`: the OS picks a free port."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "bind"
        and node.args
        and isinstance(node.args[0], ast.Tuple)
        and len(node.args[0].elts) == 2
        and isinstance(node.args[0].elts[1], ast.Constant)
        and node.args[0].elts[1].value == 0
        for node in walk(function)
    )
