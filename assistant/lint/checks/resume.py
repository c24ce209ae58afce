"""Per-rank checkpoint files under a launch that lets the world size change.

`torchrun --nnodes=2:8 --max-restarts=50 ...` in the file's docstring, or
elastic torchrun named in words (an elastic job: each restart may come back
with another number of nodes), and
each rank saving its own shard (`torch.save(state, f"shard_rank{rank}.pt")`:
a local or sharded state dict, an optimizer's shard) that it loads back by
its rank number on resuming: after a restart with another world size the
shards no longer fit the ranks (size mismatches), and new ranks find no
file and start from scratch while the others resume. Reported at the load.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.launchtext import elastic_nodes, logical_lines
from assistant.lint.model import Script, source_text, walk
from assistant.lint.ranks import compared_rank
from assistant.lint.registry import check
from assistant.results import Finding

# Elastic torchrun named in words: "elastic torchrun", "torchrun ... elastic",
# "elastic training / launch / job" (the node count is then free to change).
ELASTIC_WORDS = re.compile(
    r"\belastic\b.{0,40}\b(?:torchrun|launch|job|training|agent)\b"
    r"|\btorchrun\b.{0,40}\belastic\b",
    re.IGNORECASE,
)


@check("resume-different-world-size")
def check_rank_files_under_an_elastic_launch(script: Script) -> Iterator[Finding]:
    """torch.save and torch.load of one file per rank, under `--nnodes=MIN:MAX`."""
    elastic = elastic_nodes(script.source)
    if elastic is not None:
        launch_line, nodes = elastic[0], f"--nnodes={elastic[1]}"
    elif (said := elastic_in_words(script.source)) is not None:
        launch_line, nodes = said, "elastic torchrun"
    else:
        return
    saves = [node for node, name in script.call_names if name == "torch.save"]
    loads = [node for node, name in script.call_names if name == "torch.load"]
    saved = next((s for s in saves if len(s.args) > 1 and per_rank(script, s.args[1])), None)
    if saved is None:
        return
    for load in loads:
        if load.args and per_rank(script, load.args[0]):
            yield script.finding(
                "resume-different-world-size",
                load,
                f"the launch lets the number of nodes change between restarts "
                f"({nodes}, line {launch_line}), but each rank saves a file of its "
                f"own (line {saved.lineno}) and loads the one of its rank number here: after a "
                "restart with another world size the shards no longer fit the ranks, and "
                "new ranks find none; save a checkpoint that does not depend on the world "
                "size (torch.distributed.checkpoint, or a full state dict), or fix --nnodes",
            )
            return


def elastic_in_words(text: str) -> int | None:
    """The line where the file says in words that torchrun runs it elastic
    ("Launched with elastic torchrun so that a lost node does not kill the job"):
    a restart after a lost node comes back with fewer nodes."""
    return next((n for n, line in logical_lines(text) if ELASTIC_WORDS.search(line)), None)


def per_rank(script: Script, path: ast.expr) -> bool:
    """The path names the rank (`f"shard_rank{rank}.pt"`, `shard_path(root, rank)`),
    itself or through the one value its name is given."""
    expressions = [path]
    if isinstance(path, ast.Name | ast.Attribute):
        expressions += script.assigned_values.get(source_text(path), [])
    return any(
        (isinstance(node, ast.Name) and "rank" in node.id.lower())
        or (isinstance(node, ast.Name | ast.Attribute | ast.Call) and compared_rank(node, script))
        for expression in expressions
        for node in walk(expression)
    )
