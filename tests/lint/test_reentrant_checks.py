"""ddp-reentrant-checkpoint: which find_unused_parameters settings make reentrant
checkpointing fail under DDP (the fixtures hold the literal True case)."""

from __future__ import annotations

from snippets import lint_snippet

HEADER = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from functools import partial


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


ROLLOUT = """
def train(loader, optimizer, k):
    model = DDP(Net())
    for x, y in loader:
        loss = 0.0
        for step in range(k):
            x = model(x)
            loss = loss + (x - y).pow(2).mean()
        loss.backward()
        optimizer.step()
"""


def test_a_model_run_several_times_before_one_backward_reuses_its_checkpointed_blocks():
    """Blind set cx's 05: an autoregressive rollout of the DDP model, one backward."""
    (message,) = findings(ROLLOUT)
    assert "runs several times before one backward (line" in message


def test_a_model_run_once_per_backward_or_without_gradients_is_left_alone():
    once = (
        ROLLOUT.replace("            loss = loss + (x - y).pow(2).mean()\n", "")
        .replace("        loss.backward()\n", "")
        .replace(
            "            x = model(x)\n",
            "            x = model(x)\n            x.sum().backward()\n",
        )
    )
    assert findings(once) == []
    no_grad = ROLLOUT.replace("def train(", "@torch.no_grad()\ndef train(")
    assert findings(no_grad) == []


MULTI_CROP = """
class Wrapper(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, crops):
        return torch.cat([self.backbone(c) for c in crops]) if FLAG else self.loop(crops)

    def loop(self, crops):
        feats = []
        for c in crops:
            feats.append(self.backbone(c))
        return torch.cat(feats)


make = partial(Net)
model = DDP(Wrapper(make()))
"""


def test_a_checkpointing_module_a_wrapper_runs_once_per_crop_is_reused():
    """Blind set dd's 12: DINO's multi-crop wrapper runs the backbone (built through
    functools.partial and handed to the wrapper) once per crop size."""
    (message,) = findings(MULTI_CROP)
    assert "in Net, which Wrapper runs several times in one forward (self.backbone on line" in (
        message
    )
    once = MULTI_CROP.replace(
        "        for c in crops:\n            feats.append(self.backbone(c))\n",
        "        feats.append(self.backbone(crops[0]))\n",
    ).replace("if FLAG else", "if False else")
    assert findings(once.replace("[self.backbone(c) for c in crops]", "[crops[0]]")) == []


def test_a_comprehension_over_the_crops_runs_the_backbone_once_per_crop():
    body = MULTI_CROP.replace(
        "        for c in crops:\n            feats.append(self.backbone(c))\n", ""
    )
    assert len(findings(body)) == 1


CHUNKED = """
class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.rgbnet = nn.Linear(8, 3)
        self.chunk = 1024

    def forward(self, h):
        return torch.cat(CHUNKS)


model = DDP(Field())
"""


def test_a_module_checkpointed_chunk_by_chunk_in_a_comprehension_is_reused():
    # blind set du's 13: the colour MLP checkpointed per chunk of samples in one forward
    chunks = (
        "[checkpoint(self.rgbnet, h[s:s + self.chunk], use_reentrant=True)"
        " for s in range(0, h.shape[0], self.chunk)]"
    )
    assert any("inside a loop" in m for m in findings(CHUNKED.replace("CHUNKS", chunks)))
    once = "[checkpoint(self.rgbnet, h, use_reentrant=True)]"
    assert findings(CHUNKED.replace("CHUNKS", once)) == []
    non_reentrant = chunks.replace("use_reentrant=True", "use_reentrant=False")
    assert findings(CHUNKED.replace("CHUNKS", non_reentrant)) == []


SIAMESE = """
class ChangeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(16, 2)

    def extract(self, x):
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=True)
        return x

    def forward(self, before, after):
        return self.head(torch.cat([PAIR], dim=1))


model = DDP(ChangeNet())
"""


def test_a_method_that_checkpoints_run_on_both_images_of_a_pair_reuses_its_blocks():
    # blind set hr's 02: a Siamese change detector runs its checkpointing extractor
    # on both dates in one forward
    (message,) = findings(SIAMESE.replace("PAIR", "self.extract(before), self.extract(after)"))
    assert "in ChangeNet.extract, which ChangeNet runs several times in one forward" in message
    once = "self.extract(before), after"
    assert findings(SIAMESE.replace("PAIR", once)) == []
    stacked = "self.extract(torch.cat([before, after])).chunk(2)[0], after"
    assert findings(SIAMESE.replace("PAIR", stacked)) == []
