"""ddp-reentrant-checkpoint: which find_unused_parameters settings make reentrant
checkpointing fail under DDP (the fixtures hold the literal True case)."""

from __future__ import annotations

from snippets import lint_snippet

HEADER = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=True))

"""


def findings(body: str) -> list[str]:
    return [f.message for _line, f in lint_snippet(HEADER, body, ["ddp-reentrant-checkpoint"])]


def test_a_find_unused_parameters_the_run_decides_is_read_as_true_and_said_so():
    (message,) = findings("model = DDP(Net(), find_unused_parameters=cfg.layerdrop > 0)\n")
    assert "find_unused_parameters=cfg.layerdrop > 0, when that is true (line" in message
    assert "Expected to mark a variable ready only once" in message


def test_a_flag_from_the_command_line_is_read_the_same_way():
    (message,) = findings("model = DDP(Net(), find_unused_parameters=args.find_unused)\n")
    assert "find_unused_parameters=args.find_unused, when that is true" in message


def test_literal_false_none_or_no_setting_leave_distinct_blocks_alone():
    assert findings("model = DDP(Net(), find_unused_parameters=False)\n") == []
    assert findings("model = DDP(Net(), find_unused_parameters=None)\n") == []
    assert findings("model = DDP(Net())\n") == []


def test_a_static_graph_is_quiet_whatever_the_setting():
    body = "model = DDP(Net(), find_unused_parameters=cfg.unused, static_graph=True)\n"
    assert findings(body) == []
