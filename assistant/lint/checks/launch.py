"""Launch checks: the main guard, where the local rank comes from, a fixed world size."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator

from assistant.lint.model import Script, is_int, keyword, short, source_text
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    LOCAL_RANK_FLAGS,
    LOCAL_RANK_NAME,
    SPAWNERS,
    init_calls,
    local_rank_arguments,
    reads_env,
    uses_deepspeed,
)
from assistant.results import Finding


@check("missing-main-guard")
def check_missing_main_guard(script: Script) -> Iterator[Finding]:
    """Processes started at import time: spawn children re-run the module."""
    for call in script.traces[0]:
        if call.guarded:
            continue
        if call.name in SPAWNERS:
            what = f"{short(call.name)}() (line {call.node.lineno})"
        elif short(call.name) == "DataLoader" and positive_workers(call.node):
            what = f"a DataLoader with worker processes (line {call.node.lineno})"
        else:
            continue
        yield script.finding(
            "missing-main-guard",
            call.top_line,
            f"{what} runs at import time; spawned processes re-import the script "
            'and start it again: put it under `if __name__ == "__main__":`',
        )


def positive_workers(call: ast.Call) -> bool:
    workers = keyword(call, "num_workers")
    return is_int(workers) and workers.value > 0


@check("local-rank-not-from-env")
def check_local_rank_not_from_env(script: Script) -> Iterator[Finding]:
    """A local rank from an argparse default or a constant: every rank picks one GPU."""
    if reads_env(script, "LOCAL_RANK") or uses_deepspeed(script):
        return  # the `deepspeed` launcher passes --local_rank=N
    for node, _flags in local_rank_arguments(script):
        if not is_required(node) and not flag_value_read(script, node):
            continue  # the flag only swallows the launcher's; the rank comes from elsewhere
        default = keyword(node, "default")
        shown = source_text(default) if default is not None else "None"
        yield script.finding(
            "local-rank-not-from-env",
            node,
            f"local rank comes from a command-line flag (default {shown}); torchrun passes "
            'none, so every process gets the default: use int(os.environ["LOCAL_RANK"])',
        )
    for node in script.nodes:
        if isinstance(node, ast.Assign) and is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name) and LOCAL_RANK_NAME.match(target.id):
                    yield script.finding(
                        "local-rank-not-from-env",
                        node,
                        f"{target.id} is the constant {node.value.value}: every process "
                        'uses the same GPU; use int(os.environ["LOCAL_RANK"])',
                    )


@check("local-rank-arg-mismatch")
def check_local_rank_arg_mismatch(script: Script) -> Iterator[Finding]:
    """Only one spelling of the local-rank flag, or a flag torchrun never passes."""
    if uses_deepspeed(script):
        return  # the `deepspeed` launcher passes --local_rank=N, the spelling it expects
    for node, flags in local_rank_arguments(script):
        accepted = flags & set(LOCAL_RANK_FLAGS)
        problems = []
        if accepted == {"--local_rank"}:
            problems.append(
                "accepts --local_rank only; torch.distributed.launch in PyTorch 2.x passes "
                '--local-rank ("unrecognized arguments: --local-rank=0")'
            )
        elif accepted == {"--local-rank"}:
            problems.append(
                "accepts --local-rank only; launchers before PyTorch 2.0 pass --local_rank"
            )
        if is_required(node):
            problems.append("the flag is required, but torchrun passes none")
        if problems:
            yield script.finding(
                "local-rank-arg-mismatch", node, "; ".join(problems) + arg_fix(script, node)
            )


def arg_fix(script: Script, node: ast.Call) -> str:
    """Where the rank already comes from LOCAL_RANK, only the spellings need fixing."""
    if reads_env(script, "LOCAL_RANK") or not flag_value_read(script, node):
        return ': accept both spellings, optional: add_argument("--local-rank", "--local_rank")'
    return ': read os.environ["LOCAL_RANK"] (or accept both spellings, optional)'


def is_required(node: ast.Call) -> bool:
    required = keyword(node, "required")
    return isinstance(required, ast.Constant) and bool(required.value)


def flag_value_read(script: Script, node: ast.Call) -> bool:
    """The parsed local rank is used in this file: `args.local_rank`, `opt["local_rank"]`."""
    dest = keyword(node, "dest")
    name = dest.value if isinstance(dest, ast.Constant) else "local_rank"
    return name in script.string_constants or any(
        isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Load)
        for n in script.nodes
    )


@check("world-size-mismatch")
def check_world_size_mismatch(script: Script) -> Iterator[Finding]:
    """init_process_group with a hard-coded world_size or rank."""
    constants = module_int_constants(script)
    for node in init_calls(script):
        for name in ("world_size", "rank"):
            value = keyword(node, name)
            if is_int(value):
                fixed, source = value.value, f"{name}={value.value}"
            elif isinstance(value, ast.Name) and value.id in constants:
                fixed = constants[value.id]
                source = f"{name}={value.id}, {value.id} = {fixed}"
            else:
                continue
            yield script.finding(
                "world-size-mismatch",
                value,
                f"hard-coded {source} in init_process_group: "
                + (
                    f"if the launcher starts other than {fixed} processes, rendezvous"
                    if name == "world_size"
                    else f"every process claims rank {fixed}, so rendezvous"
                )
                + " waits and times out; leave it out under torchrun "
                "(env://) or pass the spawned rank and the real world size",
            )


def module_int_constants(script: Script) -> dict[str, int]:
    """Module-level names assigned exactly once, to an int literal (WORLD_SIZE = 4)."""
    values: dict[str, int] = {}
    assigned: Counter[str] = Counter()
    for node in script.nodes:
        targets = list(node.targets) if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Name):
                assigned[target.id] += 1
    for node in script.tree.body:
        if isinstance(node, ast.Assign) and is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return {name: value for name, value in values.items() if assigned[name] == 1}
