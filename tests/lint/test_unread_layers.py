"""unused-parameters: a layer the DDP-wrapped model builds that nothing in the file
reads (assistant/lint/checks/unread_layers.py); under torchrun, the fixture fails as
linted and its twin trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"

PRELUDE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""

# blind set gk's 17: a speed-run GPT on rotary positions that kept nanoGPT's wpe
GPT = """
class GPT(nn.Module):
    def __init__(self, vocab, width, block):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width),
            wpe=nn.Embedding(block, width),
        ))
        self.lm_head = nn.Linear(width, vocab)
        EXTRA

    def forward(self, idx, targets):
        x = self.transformer.wte(idx)
        USE
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


def main():
    dist.init_process_group("gloo")
    model = DDP(GPT(64, 16, 8)OPTIONS)
    opt = torch.optim.AdamW(model.parameters())
    for idx in range(10):
        batch = torch.randint(0, 64, (4, 8))
        loss = model(batch, batch)
        loss.backward()
        opt.step()
"""


def unread(extra: str = "pass", use: str = "pass", options: str = "") -> list[int]:
    body = GPT.replace("EXTRA", extra).replace("USE", use).replace("OPTIONS", options)
    return [line for line, _ in lint_snippet(PRELUDE, body, ["unused-parameters"])]


def test_a_module_dict_entry_nothing_reads_is_reported_at_its_construction():
    assert unread() == [7]
    [(_, finding)] = lint_snippet(
        PRELUDE,
        GPT.replace("EXTRA", "pass").replace("USE", "pass").replace("OPTIONS", ""),
        ["unused-parameters"],
    )
    assert "GPT builds wpe (Embedding), but nothing in the file ever runs or reads it" in (
        finding.message
    )


def test_the_dict_literal_spelling_and_a_plain_field_are_read_alike():
    literal = (
        GPT.replace("dict(\n            wte=", '{\n            "wte": ')
        .replace("            wpe=", '            "wpe": ')
        .replace("        ))", "        })")
        .replace("EXTRA", "pass")
        .replace("USE", "pass")
    )
    assert [
        line
        for line, _ in lint_snippet(PRELUDE, literal.replace("OPTIONS", ""), ["unused-parameters"])
    ] == [7]
    assert 10 in unread(extra="self.proj = nn.Linear(16, 16)")


@pytest.mark.parametrize(
    "extra, use, options",
    [
        # forward adds the learned positions
        ("pass", "x = x + self.transformer.wpe(torch.arange(x.size(1)))", ""),
        # DDP told to look for unused parameters
        ("pass", "pass", ", find_unused_parameters=True"),
        # frozen, or named in a string (a freeze by name, a getattr of the name)
        ("self.transformer.wpe.requires_grad_(False)", "pass", ""),
        ("self.pos_kind = 'wpe'", "pass", ""),
        # the class reaches its fields by other means
        ("pass", "x = x + sum(m.weight.sum() * 0 for m in self.children() if m is not self)", ""),
        # the ModuleDict read other than entry by named entry: any entry may run
        ("pass", "x = x + sum(m.weight.sum() * 0 for m in self.transformer.values())", ""),
        # read anywhere else (a method, weight tying, the training loop): not judged
        ("self.lm_head.weight = self.transformer.wpe.weight", "pass", ""),
    ],
)
def test_quiet_where_the_layer_may_be_read(extra, use, options):
    assert unread(extra, use, options) == []


def test_a_layer_without_parameters_or_a_loss_is_not_reported():
    assert unread(extra="self.drop = nn.Dropout(0.1)") == [7]
    assert unread(extra="self.criterion = nn.CrossEntropyLoss()") == [7]


@pytest.mark.parametrize(
    ("extra", "reported"),
    [
        # blind set hs's 06: a list of upsampling layers the forward never runs
        ("self.ups = nn.ModuleList([nn.Upsample(scale_factor=2) for _ in range(3)])", [7]),
        ("self.acts = nn.Sequential(nn.ReLU(), nn.Dropout(0.1))", [7]),
        ("self.heads = nn.ModuleDict({'a': nn.Identity(), 'b': nn.GELU()})", [7]),
        # a container that holds a layer with parameters is still reported
        ("self.ups = nn.ModuleList([nn.ConvTranspose2d(4, 4, 2) for _ in range(3)])", [7, 10]),
        ("self.extra = nn.Sequential(nn.ReLU(), nn.Linear(4, 4))", [7, 10]),
    ],
    ids=["upsample list", "activations", "dict of identities", "transposed convs", "a linear"],
)
def test_a_container_is_judged_by_the_layers_it_holds(extra, reported):
    assert unread(extra=extra) == reported


@pytest.mark.slow
def test_the_position_table_fails_under_torchrun_and_its_twin_trains(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "position_table_left_after_rotary.py",
        "Expected to have finished reduction in the prior iteration",
        SCRIPTS / "correct_position_table_removed_with_rotary.py",
        "trained",
    )
