"""unused-parameters: a training call whose own arguments (constants, forward's
defaults, a flag decided per step) route forward around a submodule, under a
DDP that expects a gradient for every parameter (assistant/lint/checks/unused_paths.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "mode_argument_routes_forward_around_a_head.py"
FIXED = SCRIPTS / "correct_mode_argument_with_every_head_trained.py"

HEADER = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""

# A model with a head only some calls reach; `{gate}` decides which.
MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.aux = nn.Linear(4, 2)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, with_aux=False, mode="train"):
        h = self.drop(self.body(x))
        {gate}
        return self.head(h), self.aux(h)
"""


def reported(gate: str, step: str, ddp: str = "DDP(Net())", extra: str = "") -> list[int]:
    body = MODEL.replace("{gate}", gate) + extra + f"\nmodel = {ddp}\n" + step
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


EARLY_EXIT = "if not with_aux:\n            return self.head(h), None"
STEP = """
def train(loader, optimizer):
    for step, (x, y) in enumerate(loader):
        {call}
        loss.backward()
        optimizer.step()
"""


def step_with(call: str) -> str:
    return STEP.replace("{call}", call)


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        BROKEN,
        "Expected to have finished reduction in the prior iteration",
        FIXED,
        "trained",
    )


@pytest.mark.parametrize(
    ("gate", "call"),
    [
        # the default leaves the flag off: forward returns before self.aux
        (EARLY_EXIT, "out, _ = model(x); loss = out.sum()"),
        # passed False in so many words
        (EARLY_EXIT, "out, _ = model(x, False); loss = out.sum()"),
        # a string mode compared with a constant
        (
            'if mode == "value":\n            return self.head(h), None',
            'out, _ = model(x, mode="value"); loss = out.sum()',
        ),
        # decided per step: an epoch count, a modulo
        (EARLY_EXIT, "out, aux = model(x, with_aux=step >= 100); loss = out.sum()"),
        (EARLY_EXIT, "use = step % 4 == 0; out, aux = model(x, with_aux=use); loss = out.sum()"),
    ],
)
def test_a_call_whose_arguments_skip_a_head_is_reported(gate, call):
    assert reported(gate, step_with(call)) != []


@pytest.mark.parametrize(
    ("gate", "call", "ddp", "extra"),
    [
        # every path runs every head
        ("pass", "out, aux = model(x); loss = out.sum() + aux.sum()", "DDP(Net())", ""),
        # the call turns the flag on: nothing is skipped
        (
            EARLY_EXIT,
            "out, aux = model(x, with_aux=True); loss = (out + aux.sum()).sum()",
            "DDP(Net())",
            "",
        ),
        # a test of the input, not of an argument: undecided, both ways count
        (
            "if x.sum() > 0:\n            return self.head(h), None",
            "out, _ = model(x); loss = out.sum()",
            "DDP(Net())",
            "",
        ),
        # DDP told to look for unused parameters
        (
            EARLY_EXIT,
            "out, _ = model(x); loss = out.sum()",
            "DDP(Net(), find_unused_parameters=True)",
            "",
        ),
        # the skipped head is frozen: no gradient expected
        (
            EARLY_EXIT,
            "out, _ = model(x); loss = out.sum()",
            "DDP(net)",
            "\nnet = Net()\nnet.aux.requires_grad_(False)\n",
        ),
    ],
)
def test_calls_that_leave_nothing_trainable_out_are_not_reported(gate, call, ddp, extra):
    assert reported(gate, step_with(call), ddp, extra) == []


def test_only_a_skipped_layer_without_parameters_is_not_reported():
    gate = "if not with_aux:\n            return self.head(self.body(x)), None"
    # the early exit skips only self.drop (a Dropout) and self.aux ... with aux frozen
    extra = "\nnet = Net()\nfor p in net.aux.parameters():\n    p.requires_grad = False\n"
    assert reported(gate, step_with("out, _ = model(x); loss = out.sum()"), "DDP(net)", extra) == []


def test_calls_without_a_backward_or_under_no_grad_are_not_steps():
    evaluate = """
def evaluate(loader):
    return [model(x)[0] for x in loader]

def train(loader, optimizer):
    for x in loader:
        with torch.no_grad():
            out, _ = model(x)
        loss = model(x, with_aux=True)[0].sum() + model(x, with_aux=True)[1].sum()
        loss.backward()
"""
    assert reported(EARLY_EXIT, evaluate) == []


def test_the_finding_names_the_argument_and_the_skipped_head():
    [(_, finding)] = lint_snippet(
        HEADER,
        MODEL.replace("{gate}", EARLY_EXIT)
        + "\nmodel = DDP(Net())\n"
        + step_with("out, _ = model(x); loss = out.sum()"),
        ["unused-parameters"],
    )
    assert "with_aux=False" in finding.message
    assert "self.aux" in finding.message
    assert "self.drop" not in finding.message
    assert "find_unused_parameters=True" in finding.message


POOLED = SCRIPTS / "pooler_no_call_of_the_encoder_asks_for.py"
POOLED_FIXED = SCRIPTS / "correct_pooler_built_only_when_asked_for.py"


@pytest.mark.slow
def test_an_encoders_pooler_no_call_asks_for_fails_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        POOLED,
        "Expected to have finished reduction in the prior iteration",
        POOLED_FIXED,
        "trained",
    )


# An encoder class of the file whose pooler runs only when a call asks for it,
# built twice into the wrapped model (blind set ar 06: ELECTRA's generator and
# discriminator); `{calls}` is the outer forward's body.
ENCODERS = """
class Encoder(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layer = nn.Linear(8, width)
        self.pooler = nn.Linear(width, width)

    def forward(self, x, return_pooled=False):
        h = self.layer(x)
        if return_pooled:
            return h, self.pooler(h)
        return h


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = Encoder(8)
        self.disc = Encoder(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        {calls}

model = DDP(Pair())
"""


def encoder_lines(calls: str, step: str = "loss = model(x).sum()") -> list[int]:
    body = ENCODERS.replace("{calls}", calls) + step_with(step)
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


def test_an_inner_models_field_no_call_of_it_reaches_is_reported():
    assert encoder_lines("return self.out(self.disc(self.gen(x) + x))") != []
    assert encoder_lines("return self.out(self.disc(self.gen(x, False) + x))") != []


@pytest.mark.parametrize(
    "calls",
    [
        # a call of each asks for the pooled output: the poolers run
        (
            "g, gp = self.gen(x, return_pooled=True)\n"
            "        h, pooled = self.disc(g + gp + x, return_pooled=True)\n"
            "        return self.out(h + pooled)"
        ),
        # a value the file does not decide may ask: they may run
        "return self.out(self.disc(self.gen(x, self.training)[0] + x, self.training)[0])",
        # the pooler read directly (a tied weight) gets its gradient that way
        "return self.out(self.disc(self.gen(x) + x)) + self.gen.pooler.weight.sum() + self.disc.pooler.weight.sum()",
    ],
)
def test_an_inner_field_some_call_may_reach_is_not_reported(calls):
    assert encoder_lines(calls) == []


# A head the model runs only under a flag it is built with (blind set as 02:
# `deep_supervision` from a config dict whose default is False).
FLAGGED = """
DEFAULTS = dict(lr=0.1, deep_supervision=False)


class Net(nn.Module):
    def __init__(self, deep_supervision=False):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.aux_head = nn.Linear(4, 2)
        self.deep_supervision = deep_supervision

    def forward(self, x):
        h = self.body(x)
        if self.training and self.deep_supervision:
            return h, self.aux_head(h)
        return h

{build}
model = DDP(net)
"""


def flagged_lines(build: str) -> list[int]:
    body = FLAGGED.replace("{build}", build) + step_with("loss = model(x)[0].sum()")
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


@pytest.mark.parametrize(
    "build",
    [
        "net = Net()",  # the constructor's default
        "net = Net(deep_supervision=False)",
        "cfg = dict(DEFAULTS)\ncfg.update({})\nnet = Net(deep_supervision=cfg['deep_supervision'])",
        "cfg = DEFAULTS.copy()\nnet = Net(cfg['deep_supervision'])",
        "cfg = {**DEFAULTS, 'lr': 0.2}\nnet = Net(cfg['deep_supervision'])",
        (
            "import argparse\np = argparse.ArgumentParser()\np.add_argument('--deep-supervision', action='store_true')\n"
            "args = p.parse_args()\nnet = Net(args.deep_supervision)"
        ),
    ],
)
def test_a_head_under_a_flag_the_model_is_built_without_is_reported(build):
    assert flagged_lines(build) != []


@pytest.mark.parametrize(
    "build",
    [
        "net = Net(deep_supervision=True)",
        "cfg = {**DEFAULTS, 'deep_supervision': True}\nnet = Net(cfg['deep_supervision'])",
        # set for this run in the file: the config entry is no default any more
        "cfg = dict(DEFAULTS)\ncfg['deep_supervision'] = True\nnet = Net(cfg['deep_supervision'])",
        # what the file does not say
        "import json\ncfg = json.load(open('c.json'))\nnet = Net(cfg['deep_supervision'])",
        # two builds that disagree
        "net = Net(False)\nother = Net(True)",
        # switched on later
        "net = Net()\nnet.deep_supervision = True",
    ],
)
def test_a_flag_the_file_may_turn_on_is_not_reported(build):
    assert flagged_lines(build) == []


@pytest.mark.slow
def test_a_bert_pooler_never_read_fails_under_torchrun_and_its_twin_runs(torchrun):
    pytest.importorskip("transformers")
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "bert_pooler_never_read_under_ddp.py",
        "Expected to have finished reduction in the prior iteration",
        SCRIPTS / "correct_bert_built_without_its_pooler.py",
        "trained",
    )


# A classifier over a Hugging Face encoder (blind set w 08: AutoModel of
# "bert-base-uncased", an option's default, read only at the [CLS] token).
BERT_CLASSIFIER = """
import argparse
from transformers import AutoModel
parser = argparse.ArgumentParser()
parser.add_argument("--model", default="bert-base-uncased")
args = parser.parse_args()


class Classifier(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)
        self.head = nn.Linear(768, 2)

    def forward(self, ids):
        out = self.enc(input_ids=ids)
        return self.head(out.last_hidden_state[:, 0])


model = DDP(Classifier(args.model))
"""


def pooled_lines(change: dict[str, str]) -> list[int]:
    body = BERT_CLASSIFIER
    for old, new in change.items():
        body = body.replace(old, new)
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


@pytest.mark.parametrize(
    "change",
    [
        {},
        {'default="bert-base-uncased"': 'default="xlm-roberta-large"'},
        {"Classifier(args.model)": "Classifier('roberta-base')"},
        {"out.last_hidden_state[:, 0]": "out[0][:, 0]"},
        {"AutoModel.from_pretrained(name)": "BertModel.from_pretrained(name)"},
    ],
)
def test_a_pooler_built_and_never_read_is_reported(change):
    assert pooled_lines(change) == [12]


def test_an_options_default_named_by_a_constant_is_its_checkpoint():
    # blind set av: `ENCODER = "...PubMedBERT..."` at the top, `default=ENCODER`
    constant = {
        "parser = argparse": 'ENCODER = "microsoft/BiomedNLP-PubMedBERT-base-uncased"\nparser = argparse',
        'default="bert-base-uncased"': "default=ENCODER",
    }
    assert pooled_lines(constant) == [13]
    reassigned = {**constant, "args = parser": 'ENCODER = "distilbert-base-uncased"\nargs = parser'}
    assert pooled_lines(reassigned) == []


@pytest.mark.parametrize(
    "change",
    [
        {"out.last_hidden_state[:, 0]": "out.pooler_output"},
        {"out.last_hidden_state[:, 0]": "out[1]"},
        {"from_pretrained(name)": "from_pretrained(name, add_pooling_layer=False)"},
        # no pooler in these families, or a checkpoint the file does not name
        {'default="bert-base-uncased"': 'default="distilbert-base-uncased"'},
        {'default="bert-base-uncased"': 'default="microsoft/deberta-v3-base"'},
        {', default="bert-base-uncased"': ", required=True"},
        # the output handed on whole: the callee may read the pooled output
        {"return self.head(out.last_hidden_state[:, 0])": "return self.head(pick(out))"},
        {"DDP(Classifier(args.model))": "DDP(Classifier(args.model), find_unused_parameters=True)"},
    ],
)
def test_a_pooler_read_left_out_or_not_known_is_not_reported(change):
    assert pooled_lines(change) == []


# A detector's mask head run only on the instances that carry a mask: a batch
# with none leaves it out (blind set be's 09); `{gate}` is the test.
SIZED = """
class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.box_head = nn.Linear(4, 4)
        self.mask_head = nn.Linear(4, 1)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])

    def mask_logits(self, feats, boxes):
        return self.mask_head(feats[: len(boxes)])

    def forward(self, x, boxes):
        feats = self.blocks[0](self.backbone(x))
        if not self.training:
            return self.mask_logits(feats, boxes)
        loss = self.box_head(feats).sum()
        n_inst = sum(b.shape[0] for b in boxes)
        {gate}
        return loss
"""


def sized_reported(gate: str, ddp: str = "DDP(Detector())") -> list[int]:
    body = SIZED.replace("{gate}", gate) + f"\nmodel = {ddp}\n" + step_with("loss = model(x, y)")
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


@pytest.mark.parametrize(
    "gate",
    [
        "if n_inst > 0:\n            loss = loss + self.mask_logits(feats, boxes).sum()",
        "if n_inst == 0:\n            return loss\n        loss = loss + self.mask_head(feats).sum()",
        "if boxes.numel():\n            loss = loss + self.mask_head(feats).sum()",
        "if not len(boxes):\n            return loss\n        loss = loss + self.mask_head(feats).sum()",
    ],
    ids=["count-above-zero", "none-returns", "numel", "not-len"],
)
def test_a_head_run_only_when_the_batch_holds_items_is_reported(gate):
    assert sized_reported(gate) == [19]


@pytest.mark.parametrize(
    "gate, ddp",
    [
        # the head runs on an empty selection too: its gradient is zero, but there
        ("loss = loss + self.mask_head(feats[:n_inst]).sum()", "DDP(Detector())"),
        (
            "if n_inst > 0:\n            loss = loss + self.mask_head(feats).sum()",
            "DDP(Detector(), find_unused_parameters=True)",
        ),
        # the model's own structure, not the batch, decides
        (
            "if len(self.blocks) > 0:\n            loss = loss + self.mask_head(feats).sum()",
            "DDP(Detector())",
        ),
        # both sides run the head
        (
            (
                "if n_inst > 0:\n            loss = loss + self.mask_head(feats).sum()\n"
                "        else:\n            loss = loss + 0 * self.mask_head(feats).sum()"
            ),
            "DDP(Detector())",
        ),
    ],
    ids=["always-run", "find-unused", "model-structure", "both-sides"],
)
def test_a_head_every_step_reaches_or_a_ddp_that_looks_is_not_reported(gate, ddp):
    assert sized_reported(gate, ddp) == []


# Blind set bg's 01: two output heads, one picked by a mode the model is built with.
MODED = """
import argparse


class Forecaster(nn.Module):
    def __init__(self, output_mode):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.quantile_head = nn.Linear(4, 3)
        self.point_head = nn.Linear(4, 1)
        self.output_mode = output_mode

    def forward(self, x):
        h = self.body(x)
        if self.output_mode == "quantile":
            return self.quantile_head(h)
        return self.point_head(h)


p = argparse.ArgumentParser()
p.add_argument("--output-mode", choices=["quantile", "point"], default="quantile")
args = p.parse_args()
model = DDP({built})
"""


@pytest.mark.parametrize(
    "built, reported",
    [
        ("Forecaster(args.output_mode)", True),
        ('Forecaster("point")', True),
        ("Forecaster(args.output_mode), find_unused_parameters=True", False),
    ],
    ids=["option-default", "constant", "find-unused"],
)
def test_a_head_a_mode_the_model_is_built_with_never_picks_is_reported(built, reported):
    body = MODED.replace("{built}", built) + step_with("loss = model(x).sum()")
    found = [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]
    assert bool(found) == reported, found


TOWERS = """
def tower(width, sizes):
    layers = []
    for h in sizes:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 1))


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.ctr = tower(8, [16])
        self.cvr = {cvr}

    def forward(self, x, with_cvr=True):
        if not with_cvr:
            return self.ctr(x), None
        return self.ctr(x), self.cvr(x)


model = DDP(TwoTowers())
for step, (x, click, conv) in enumerate(loader):
    known = conv >= 0
    ctr, cvr = model(x, with_cvr=bool(known.any()))
    ctr.sum().backward()
"""


@pytest.mark.parametrize(
    "cvr, reported",
    [
        # blind set bv's 13: a tower a function of the file builds, run only on the
        # batches that hold a known label
        ("tower(8, [16])", [24]),
        ("make_frozen_tower()", []),  # the file does not show what it builds
    ],
)
def test_a_layer_a_function_of_the_file_builds_is_trainable(cvr, reported):
    body = TOWERS.replace("{cvr}", cvr)
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == reported


# Blind set cn's 03: the mode read from a config object the model is given, whose
# dataclass default picks one head.
CONFIGURED = """
from dataclasses import dataclass


@dataclass
class Config:
    width: int = 4
    pool: str = "mean"


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pool = cfg.pool
        self.body = nn.Linear(cfg.width, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.body(x)
        if self.pool == "cls":
            h = h + self.cls_token
        return self.head(h)


cfg = Config()
{override}
model = DDP(Encoder(cfg))
"""


@pytest.mark.parametrize(
    "override, reported",
    [
        ("", True),  # the dataclass default leaves the token out
        ("cfg.pool = 'cls'", False),  # the file sets it: not the default's
        ("cfg = Config(pool='cls')", False),
        ("cfg = Config(4, 'cls')", False),
        # blind set co's 05: options named after the fields, unpacked into the class
        ("cfg = Config(**vars(parser.parse_args()))", True),
    ],
)
def test_a_mode_a_config_dataclass_defaults_to_is_a_built_flag(override, reported):
    body = CONFIGURED.replace("{override}", override) + step_with("loss = model(x).sum()")
    found = [f.message for _, f in lint_snippet(HEADER, body, ["unused-parameters"])]
    assert bool(found) == reported, found
    if reported:
        assert "self.cls_token" in found[0] and "'mean'" in found[0]


# Blind set cp's 09: one head of a ModuleDict picked per call by the loss the run uses.
PICKED_HEAD = """
class TiDE(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.loss_type = loss
        self.body = nn.Linear(4, 4)
        self.heads = {heads}

    def forward(self, x):
        h = self.body(x)
        {pick}


model = DDP(TiDE("mse"))
"""


@pytest.mark.parametrize(
    "heads, pick, reported",
    [
        (
            'nn.ModuleDict({"point": nn.Linear(4, 1), "quantile": nn.Linear(4, 3)})',
            (
                'key = "quantile" if self.loss_type == "quantile" else "point"\n'
                "        return self.heads[key](h)"
            ),
            True,
        ),
        (
            "nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])",
            "return self.heads[self.task](h)",
            True,
        ),
        # every entry runs
        (
            'nn.ModuleDict({"point": nn.Linear(4, 1), "quantile": nn.Linear(4, 3)})',
            "return [head(h) for head in self.heads.values()]",
            False,
        ),
        (
            "nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])",
            "return sum(self.heads[i](h) for i in range(len(self.heads)))",
            False,
        ),
        # one entry: nothing left out
        ('nn.ModuleDict({"point": nn.Linear(4, 1)})', 'return self.heads["point"](h)', False),
    ],
)
def test_one_entry_of_a_module_dict_picked_per_call_leaves_the_others_out(heads, pick, reported):
    body = PICKED_HEAD.replace("{heads}", heads).replace("{pick}", pick) + step_with(
        "loss = model(x).sum()"
    )
    found = [f.message for _, f in lint_snippet(HEADER, body, ["unused-parameters"])]
    assert bool(found) == reported, found
    if reported:
        assert "self.heads" in found[0]


# Blind set cr's 10: a trainer's step counter field decides whether the fine network runs.
WARMUP_FIELD = """
class Nerf(nn.Module):
    def __init__(self):
        super().__init__()
        self.coarse = nn.Linear(4, 4)
        self.fine = nn.Linear(4, 4)

    def forward(self, x, use_fine=True):
        out = {"coarse": self.coarse(x)}
        if use_fine:
            out["fine"] = self.fine(x)
        return out


class Trainer:
    def __init__(self):
        self.model = DDP(Nerf())
        self.step = 0

    def train_step(self, x):
        use_fine = GATE
        out = self.model(x, use_fine=use_fine)
        loss = out["coarse"].sum()
        if use_fine:
            loss = loss + out["fine"].sum()
        loss.backward()

    def fit(self, loader):
        for x in loader:
            self.train_step(x)
            self.step += 1
"""


@pytest.mark.parametrize(
    "gate, reported",
    [
        ("self.step >= 2000", True),
        ("self.global_step > self.cfg.warmup", True),
        ("self.cfg.use_fine", False),  # one value for the whole run, every step alike
    ],
)
def test_a_step_counter_field_compared_decides_per_step(gate, reported):
    found = lint_snippet(HEADER, WARMUP_FIELD.replace("GATE", gate), ["unused-parameters"])
    assert bool(found) == reported, found


SIDE_METHOD = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.key_head = nn.Linear(4, 3)

    def forward(self, x):
        return self.body(x)

    def key_logits(self, h):
        return self.key_head(h.mean(0, keepdim=True))


def train(loader, optimizer):
    model = DDP(Net())
    for x, key in loader:
        h = model(x)
        loss = h.sum()
        has_key = key >= 0
        {call}
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize(
    ("call", "reported"),
    [
        # blind set ct's 10: a key head only a method besides forward runs, called
        # when the batch holds an annotated song
        ("if has_key.any():\n            loss = loss + model.module.key_logits(h).sum()", [21]),
        # every step: the head gets a gradient each step
        ("loss = loss + model.module.key_logits(h).sum()", []),
        # decided once for the run, not per step
        ("if USE_KEY:\n            loss = loss + model.module.key_logits(h).sum()", []),
    ],
)
def test_a_method_besides_forward_called_on_some_steps_leaves_its_submodules_out(call, reported):
    body = SIDE_METHOD.replace("{call}", call)
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == reported


@pytest.mark.parametrize(
    ("flag", "reported_lines"),
    [
        # blind set cx's 20: the head trains only when the run turns the option on
        ('parser.add_argument("--aux", action="store_true")', [24]),
        ('parser.add_argument("--aux", type=int, default=1)', []),
        ('parser.add_argument("--aux", required=True)', []),  # every run names it
    ],
)
def test_an_option_passed_as_it_is_routes_forward_by_its_default(flag, reported_lines):
    extra = f"\nparser = argparse.ArgumentParser()\n{flag}\nargs = parser.parse_args()\n"
    step = step_with("out, aux = model(x, with_aux=args.aux)\n        loss = out.sum()")
    assert reported(EARLY_EXIT, step, extra=extra) == reported_lines


@pytest.mark.parametrize(
    ("default", "reported_lines"),
    [
        # blind sets cy's 11, da's 11: an auxiliary weight of 0 by default turns the
        # head off through a name the step passes
        ("0.0", [25]),
        ("0.5", []),
    ],
)
def test_a_name_made_of_options_at_their_defaults_routes_forward(default, reported_lines):
    extra = (
        "\nparser = argparse.ArgumentParser()\n"
        f'parser.add_argument("--aux-weight", type=float, default={default})\n'
        "args = parser.parse_args()\n"
    )
    step = STEP.replace(
        "def train(loader, optimizer):\n",
        "def train(loader, optimizer):\n    use_aux = args.aux_weight > 0\n",
    ).replace("{call}", "out, aux = model(x, with_aux=use_aux)\n        loss = out.sum()")
    assert reported(EARLY_EXIT, step, extra=extra) == reported_lines


# Blind set hw's 06: a matcher's confidence heads, run only to stop early in evaluation.
EVAL_ONLY_HEADS = """
class Matcher(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.assign = nn.Linear(4, 1)
        self.confidence = nn.ModuleList([nn.Linear(4, 1) for _ in range(2)])

    def forward(self, x):
        stop_early = not self.training
        outs = []
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.training:
                outs.append(self.assign(x))
            elif stop_early and i < 2:
                if self.confidence[i](x).mean() > 0.9:
                    break
        if not self.training:
            outs.append(self.assign(x))
        return outs
"""


@pytest.mark.parametrize(
    "ddp, step, reported_lines",
    [
        ("DDP(Matcher())", "loss = model(x)[-1].sum()", [17]),
        ("DDP(Matcher(), find_unused_parameters=True)", "loss = model(x)[-1].sum()", []),
        # the training step itself puts the model in eval mode: forward's test is not decided
        ("DDP(Matcher())", "model.eval()\n        loss = model(x)[-1].sum()", []),
    ],
    ids=["strict", "unused allowed", "eval mode in the step"],
)
def test_heads_forward_runs_only_in_eval_mode_get_no_gradient(ddp, step, reported_lines):
    body = EVAL_ONLY_HEADS + f"\nmodel = {ddp}\n" + step_with(step)
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == (
        reported_lines
    )


TURNS = """
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.count_head = nn.Linear(4, 1)
        self.disease_head = nn.Linear(4, 3)

    def forward(self, x, task):
        f = self.body(x)
        if task == "count":
            return self.count_head(f)
        return self.disease_head(f)


model = DDP(TwoHeads())


def train(loader, optimizer):
    for x, y in loader:
        for task in ("count", "disease"):
            loss = model(x, task).sum()
            BACKWARD
"""


@pytest.mark.parametrize(
    "backward, reported_lines",
    [
        # blind set ik's 17: each task's own step, a backward per turn
        ("loss.backward()\n            optimizer.step()", [21]),
    ],
    ids=["a backward per task"],
)
def test_a_loop_over_tasks_with_a_backward_each_leaves_the_other_head_out(backward, reported_lines):
    body = TURNS.replace("BACKWARD", backward)
    found = lint_snippet(HEADER, body, ["unused-parameters"])
    assert [line for line, _ in found] == reported_lines
    assert "on the steps where task is 'count'" in found[0][1].message
    # both heads summed into one backward: every parameter has its gradient
    one_step = (
        TURNS.replace("            BACKWARD\n", "")
        .replace("        for task in", "        loss = 0\n        for task in")
        .replace("loss = model(x, task).sum()", "loss = loss + model(x, task).sum()")
    ) + "        loss.backward()\n"
    assert "loss = loss + model" in one_step
    assert lint_snippet(HEADER, one_step, ["unused-parameters"]) == []


@pytest.mark.parametrize(
    ("gate", "call", "reported_lines"),
    [
        # blind set ji's 11: a flag the step's batch decides
        (
            EARLY_EXIT,
            "use = bool(y.any()); out, aux = model(x, with_aux=use); loss = out.sum()",
            [22],
        ),
        # blind set jk's 11: a mode drawn with the batch from an iterator of alternating loaders
        (
            'if mode == "tail":\n            return self.head(h), None',
            "x, y, m = next(it); out, aux = model(x, mode=m); loss = out.sum() + aux.sum()",
            [22],
        ),
        # blind set jj's 18: a ratio that is 0 on the steps without the auxiliary task
        (
            (
                "if mode > 0:\n            return self.head(h), self.aux(h)\n"
                "        return self.head(h), None"
            ),
            "r = 0.15 if step % 4 == 0 else 0.0; out, aux = model(x, mode=r); loss = out.sum()",
            [23],
        ),
        # the batch itself handed in, its truth never tested: both ways reach the head
        (
            "if with_aux is not None:\n            h = h + 1",
            "out, aux = model(x, with_aux=y); loss = out.sum() + aux.sum()",
            [],
        ),
    ],
    ids=["flag from the batch", "mode drawn with the batch", "ratio zero some steps", "input"],
)
def test_an_argument_the_steps_batch_decides_routes_forward_per_step(gate, call, reported_lines):
    step = STEP.replace("for step, (x, y) in enumerate(loader):", "for step in range(100):")
    step = step.replace(
        "    {call}", "    it = iter(loader)\n        x, y = next(it)\n        {call}"
    )
    assert reported(gate, step.replace("{call}", call)) == reported_lines


def test_a_model_wrapped_from_a_field_of_the_trainer_is_followed():
    # blind set jl's 12: `self.model = DDP(self.net, ...)` with `self.net = Net()`
    body = (
        MODEL.replace("{gate}", EARLY_EXIT)
        + """
class Trainer:
    def __init__(self):
        self.net = Net()
        self.model = DDP(self.net)
        self.step = 0

    def train_step(self, x):
        out, aux = self.model(x, with_aux=self.step >= 100)
        out.sum().backward()
        self.step += 1
"""
    )
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == [23]


def test_an_input_given_or_dropped_to_none_is_named_so():
    # blind set ao's 07: the class label given on most steps, None on some
    gate = "if with_aux is None:\n            return self.head(h), self.aux(h)\n        return self.head(h), None"
    call = (
        "lab = None if step % 10 == 0 else y; out, aux = model(x, with_aux=lab); loss = out.sum()"
    )
    body = MODEL.replace("{gate}", gate) + "\nmodel = DDP(Net())\n" + step_with(call)
    found = lint_snippet(HEADER, body, ["unused-parameters"])
    assert [f.message.split(",")[0] for _, f in found] == ["on the steps where lab is not None"]
