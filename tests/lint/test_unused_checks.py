"""unused-parameters: a branch drawn at random that skips submodules under a DDP
that expects a gradient for every parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

from assistant.lint import lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "random_branch_skips_a_submodule.py"
FIXED = SCRIPTS / "correct_random_branch_with_unused_parameters_found.py"

HEADER = """
import random
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        BROKEN,
        "Expected to have finished reduction in the prior iteration",
        FIXED,
        "trained",
    )


def test_layer_drop_in_a_block_the_model_builds_is_reported():
    lines = reported_lines(
        """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.mlp = nn.Linear(4, 4)
            def forward(self, x):
                if self.training and torch.rand(1).item() < 0.1:
                    return x
                return x + self.mlp(x)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(4)])
            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        model = DDP(Net())
        """
    )
    assert lines == [7]


def test_stochastic_depth_that_continues_past_a_layer_of_a_loop_is_reported():
    # blind set ag 12: `if self.training and torch.rand(()) < p: continue` before
    # `x = layer(x)`, the layer a loop over the model's ModuleList binds
    body = """
        class Net(nn.Module):
            def __init__(self, depth=0.1):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
                self.probs = [depth * (i + 1) / 4 for i in range(4)]
            def forward(self, x):
                for layer, p in zip(self.layers, self.probs):
                    if self.training and torch.rand(()) < p:
                        continue
                    x = layer(x)
                return x

        model = DDP(Net())
        """
    assert reported_lines(body) == [9]
    # a random draw that skips no layer: a noise scale, then every layer runs
    noise = body.replace("continue", "x = x + torch.randn_like(x)")
    assert reported_lines(noise) == []


@pytest.mark.slow
def test_a_library_models_layerdrop_fails_under_torchrun_and_its_twin_runs(torchrun):
    pytest.importorskip("transformers")
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "wav2vec2_layerdrop_under_strict_ddp.py",
        "Expected to have finished reduction in the prior iteration",
        SCRIPTS / "correct_wav2vec2_layerdrop_off_under_ddp.py",
        "trained",
    )


LIBRARY_LAYERDROP = """
import argparse
from transformers import Wav2Vec2ForCTC
parser = argparse.ArgumentParser()
parser.add_argument("--layerdrop", type=float, default=0.1)
args = parser.parse_args()
model = Wav2Vec2ForCTC.from_pretrained("facebook/wav2vec2-base", layerdrop=args.layerdrop)
model = DDP(model.cuda())
"""


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        ({}, [7]),  # blind set aq 04: an option whose default drops layers
        ({"layerdrop=args.layerdrop": "layerdrop=0.05"}, [7]),
        ({"layerdrop=args.layerdrop": "encoder_layerdrop=0.1"}, [7]),
        ({"default=0.1": "default=0.0"}, []),
        ({"layerdrop=args.layerdrop": "layerdrop=0.0"}, []),
        ({"model.cuda())": "model.cuda(), find_unused_parameters=True)"}, []),
        # the module given by keyword: not followed, and the check does not break on it
        ({"DDP(model.cuda())": "DDP(module=model.cuda())"}, []),
        # the option given on the command line only: the file does not say
        ({", default=0.1": ", required=True"}, []),
    ],
)
def test_a_library_model_built_with_layerdrop_under_a_strict_ddp(change, reported):
    body = LIBRARY_LAYERDROP
    for old, new in change.items():
        body = body.replace(old, new)
    assert reported_lines(body) == reported


def test_random_values_outside_tests_or_tests_that_skip_no_submodule_are_not():
    lines = reported_lines(
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 4)
            def forward(self, x):
                mask = torch.rand_like(x) < 0.1
                x = self.a(x.masked_fill(mask, 0.0))
                if random.random() < 0.5:
                    x = x.flip(0)
                return x

        model = DDP(Net())
        """
    )
    assert lines == []


def test_a_random_branch_under_a_ddp_that_finds_unused_parameters_is_not():
    lines = reported_lines(
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            def forward(self, x):
                if random.random() < 0.5:
                    return self.a(x)
                return self.b(x)

        model = DDP(Net(), find_unused_parameters=True)
        """
    )
    assert lines == []


DISCARDED = SCRIPTS / "output_discarded_by_the_training_step.py"
EVERY_OUTPUT = SCRIPTS / "correct_every_output_trained.py"


@pytest.mark.slow
def test_an_output_thrown_away_fails_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        DISCARDED,
        "Expected to have finished reduction in the prior iteration",
        EVERY_OUTPUT,
        "trained rank",
    )


HEADS = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.aux = nn.Linear(4, 1)
    def forward(self, x):
        h = self.body(x)
        return self.head(h), AUX
model = DDP(Net()OPTIONS)
for x in loader:
    UNPACK = model(x)
    loss_fn(out).backward()
"""


@pytest.mark.parametrize(
    ("aux", "unpack", "options", "reported"),
    [
        ("self.aux(h)", "out, _", "", [13]),
        ("self.aux(h)", "out, aux", "", []),  # both kept
        # the discarded output runs no submodule of its own (self.aux is then read
        # nowhere: unread_layers' finding, at its construction)
        ("h.mean()", "out, _", "", [7]),
        ("self.head(h).sum()", "out, _", "", [7]),  # its submodule also feeds the kept output
        ("self.aux(h)", "out, _", ", find_unused_parameters=True", []),
    ],
    ids=["discarded-head", "kept", "no-submodule", "shared", "find-unused"],
)
def test_an_output_the_step_throws_away(aux, unpack, options, reported):
    body = HEADS.replace("AUX", aux).replace("UNPACK", unpack).replace("OPTIONS", options)
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == reported


AUX_MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.aux_head = nn.Linear(4, 1)
    def forward(self, x):
        f = self.body(x)
        return self.head(f), self.aux_head(f)

model = DDP(Net())
for epoch in range(10):
    {weight}
    for x, y in loader:
        out, aux = model(x)
        loss = (out - y).pow(2).mean()
        if aux_w > 0:
            loss = loss + aux_w * (aux - y).pow(2).mean()
        loss.backward()
"""


@pytest.mark.parametrize(
    ("weight", "reported"),
    [
        # the weight a gate tests is itself decided by the epoch
        ("aux_w = 0.5 if epoch < 3 else 0.0", [18]),
        ("aux_w = cfg.aux_weight * (epoch >= cfg.aux_start)", [18]),
        # a weight fixed for the whole run: every step takes the term, or none does
        ("aux_w = cfg.aux_weight", []),
    ],
)
def test_an_output_gated_by_a_weight_the_epoch_decides(weight, reported):
    assert reported_lines(AUX_MODEL.replace("{weight}", weight)) == reported


def test_a_loop_inside_the_step_holds_no_batch():
    """`for name in enabled:` inside the step runs the same names every step: a
    gate on its variable decides nothing per step (only the loops around the
    model's call hold the step's batch)."""
    body = AUX_MODEL.replace("{weight}", "enabled = cfg.losses").replace(
        "        if aux_w > 0:\n            loss = loss + aux_w * (aux - y).pow(2).mean()\n",
        "        for name in enabled:\n"
        '            if name == "aux":\n'
        "                loss = loss + (aux - y).pow(2).mean()\n",
    )
    assert 'if name == "aux":' in body
    assert reported_lines(body) == []


def test_an_update_that_starts_after_warm_up_runs_forward_under_the_same_gate():
    """Blind set an's 08 (SAC): `if step >= seed_steps:` holds the critic's call,
    its loss and the backward: the steps it skips run no forward either."""
    body = AUX_MODEL.replace("{weight}", "warm = 1000").replace(
        "        out, aux = model(x)\n"
        "        loss = (out - y).pow(2).mean()\n"
        "        if aux_w > 0:\n"
        "            loss = loss + aux_w * (aux - y).pow(2).mean()\n"
        "        loss.backward()\n",
        "        if epoch >= warm:\n"
        "            out, aux = model(x)\n"
        "            loss = (out - y).pow(2).mean() + (aux - y).pow(2).mean()\n"
        "            loss.backward()\n",
    )
    assert "if epoch >= warm:" in body
    assert reported_lines(body) == []
    # the outputs taken apart under a gate of their own inside it still count
    inner = body.replace(
        "(out - y).pow(2).mean() + (aux - y).pow(2).mean()\n",
        "(out - y).pow(2).mean()\n"
        "            if epoch % 2 == 0:\n"
        "                loss = loss + (aux - y).pow(2).mean()\n",
    )
    assert reported_lines(inner) == [19]


MIXED_DATA_MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.depth_head = nn.Linear(4, 1)
    def forward(self, x):
        f = self.body(x)
        return self.head(f), self.depth_head(f)

def joint_loss(out, depth, batch):
    loss = (out - batch["y"]).pow(2).mean()
    {loss_body}
    return loss

model = DDP(Net(){options})
for epoch in range(10):
    for i, batch in enumerate(loader):
        batch = {k: v.cuda() for k, v in batch.items()}
        out, depth = model(batch["x"])
        loss = joint_loss(out, depth, batch)
        loss.backward()
"""

HAS_3D = """has3d = batch["has3d"] > 0
    if has3d.any():
        loss = loss + (depth[has3d] - batch["z"][has3d]).abs().mean()"""


@pytest.mark.parametrize(
    ("loss_body", "options", "reported"),
    [
        # the depth term only when the step's batch holds a sample with depth
        (HAS_3D, "", [15]),
        ('if batch["z"].numel():\n        loss = loss + depth.mean()', "", [14]),
        # the same with unused parameters allowed, or the term taken every step
        (HAS_3D, ", find_unused_parameters=True", []),
        (HAS_3D + "\n    else:\n        loss = loss + 0 * depth.sum()", "", []),
        ("loss = loss + (depth - batch['z']).abs().mean()", "", []),
        # a switch fixed for the whole run decides nothing per step
        ("if cfg.use_depth:\n        loss = loss + depth.mean()", "", []),
    ],
)
def test_an_output_a_loss_function_takes_only_for_some_batches(loss_body, options, reported):
    body = MIXED_DATA_MODEL.replace("{loss_body}", loss_body).replace("{options}", options)
    assert reported_lines(body) == reported


def test_an_output_gated_by_the_batch_in_the_training_loop_is_reported():
    body = MIXED_DATA_MODEL.replace("{loss_body}", "").replace("{options}", "")
    body = body.replace(
        "        loss = joint_loss(out, depth, batch)\n",
        "        loss = joint_loss(out, None, batch)\n"
        '        if batch["has3d"].any():\n'
        "            loss = loss + depth.mean()\n",
    )
    assert reported_lines(body) == [23]


TWO_HEAD_MODEL = """
import argparse
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.fc_verb = nn.Linear(4, 3)
        self.fc_noun = nn.Linear(4, 5)
    def forward(self, x):
        f = self.body(x)
        return self.fc_verb(f), self.fc_noun(f)

def compute_loss(verb_logits, noun_logits, verb, noun, task):
    if task == "verb":
        return F.cross_entropy(verb_logits, verb)
    if task == "noun":
        return F.cross_entropy(noun_logits, noun)
    return F.cross_entropy(verb_logits, verb) + F.cross_entropy(noun_logits, noun)

ap = argparse.ArgumentParser()
ap.add_argument("--task", choices=["verb", "noun", "both"], default={default})
args = ap.parse_args()
model = DDP(Net(){options})
for x, verb, noun in loader:
    verb_logits, noun_logits = model(x)
    compute_loss(verb_logits, noun_logits, verb, noun, args.task).backward()
"""


@pytest.mark.parametrize(
    ("default", "options", "reported"),
    [
        # the option's default leaves the noun head (or the verb head) out of the loss
        ('"verb"', "", [15]),
        ('"noun"', "", [15]),
        # both heads by default, unused parameters allowed, or no default to read
        ('"both"', "", []),
        ('"verb"', ", find_unused_parameters=True", []),
        ("os.environ.get('TASK', 'verb')", "", []),
        # a required option: every run names one, its default never applies
        ('"verb", required=True', "", []),
    ],
)
def test_a_head_the_default_option_leaves_out_of_the_loss(default, options, reported):
    body = TWO_HEAD_MODEL.replace("{default}", default).replace("{options}", options)
    assert reported_lines("import torch.nn.functional as F\n" + body) == reported


def test_the_finding_names_the_option_its_default_and_the_head():
    body = TWO_HEAD_MODEL.replace("{default}", '"verb"').replace("{options}", "")
    [(_, finding)] = lint_snippet(
        HEADER, "import torch.nn.functional as F\n" + body, ["unused-parameters"]
    )
    assert "with args.task at its default ('verb'), compute_loss never reads noun_logits" in (
        finding.message
    )
    assert "self.fc_noun" in finding.message


VARIABLE_SUBSET_MODEL = """
class Net(nn.Module):
    def __init__(self, n_vars):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Linear(4, 8) for _ in range(n_vars))
    def forward(self, x, var_idx):
        toks = [self.embeds[v](x[:, j]) for j, v in enumerate(var_idx)]
        return torch.stack(toks, 1).mean()

model = DDP(Net(10){options})
all_idx = list(range(10))
for x in loader:
    {chosen}
    model(x[:, var_idx], var_idx).backward()
"""


@pytest.mark.parametrize(
    ("chosen", "options", "reported"),
    [
        # a random subset of the input variables each step: the other embeddings idle
        ("var_idx = sorted(random.sample(all_idx, random.randint(3, 10)))", "", [7]),
        ("var_idx = torch.randperm(10)[:5].tolist()", "", [7]),
        # every variable every step, or unused parameters allowed
        ("var_idx = all_idx", "", []),
        ("var_idx = sorted(random.sample(all_idx, 5))", ", find_unused_parameters=True", []),
    ],
)
def test_members_run_for_a_list_the_step_draws(chosen, options, reported):
    body = VARIABLE_SUBSET_MODEL.replace("{chosen}", chosen).replace("{options}", options)
    assert reported_lines(body) == reported


@pytest.mark.slow
def test_an_aux_classifier_left_out_fails_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "aux_classifier_left_out_after_some_epochs.py",
        "Expected to have finished reduction in the prior iteration",
        SCRIPTS / "correct_aux_classifier_weighted_zero_after_some_epochs.py",
        "trained",
    )


LIBRARY_AUX = """
from torchvision import models
model = DDP(models.{build}, device_ids=[0]{options})
for epoch in range(10):
    use_aux = epoch < 3
    for x, y in loader:
        outputs = model(x)
        loss = criterion(outputs{main}, y)
        if {gate}:
            loss = loss + 0.4 * criterion(outputs{aux}, y)
        loss.backward()
"""


@pytest.mark.parametrize(
    ("build", "options", "main", "aux", "gate", "reported"),
    [
        ("deeplabv3_resnet50(aux_loss=True)", "", '["out"]', '["aux"]', "use_aux", [9]),
        ("inception_v3(aux_logits=True)", "", ".logits", ".aux_logits", "use_aux", [9]),
        # every step takes the auxiliary term, or the model has no auxiliary head
        ("deeplabv3_resnet50(aux_loss=True)", "", '["out"]', '["aux"]', "True", []),
        ("deeplabv3_resnet50(aux_loss=False)", "", '["out"]', '["aux"]', "use_aux", []),
        # DDP told to look for unused parameters
        (
            "deeplabv3_resnet50(aux_loss=True)",
            ", find_unused_parameters=True",
            '["out"]',
            '["aux"]',
            "use_aux",
            [],
        ),
    ],
)
def test_a_library_models_aux_classifier_taken_on_some_steps(
    build, options, main, aux, gate, reported
):
    body = (
        LIBRARY_AUX.replace("{build}", build)
        .replace("{options}", options)
        .replace("{main}", main)
        .replace("{aux}", aux)
        .replace("{gate}", gate)
    )
    assert reported_lines(body) == reported


BACKBONE = """
import torchvision


class ReID(nn.Module):
    def __init__(self, n):
        super().__init__()
        base = torchvision.models.resnet50()
        self.base = base
        self.head = nn.Linear(2048, n)

    def forward(self, x):
        b = self.base
        x = b.layer4(b.layer3(b.layer2(b.layer1(b.maxpool(b.relu(b.bn1(b.conv1(x))))))))
        return self.head(x.mean((2, 3)))


model = DDP(ReID(10))
"""


def test_a_library_backbone_run_piece_by_piece_without_its_head_is_reported():
    """Blind set ad's 19: resnet50's fc is kept but never run."""
    assert reported_lines(BACKBONE) == [8]


@pytest.mark.parametrize(
    "change",
    [
        (
            "        self.base = base\n",
            "        base.fc = nn.Identity()\n        self.base = base\n",
        ),
        ("        self.base = base\n", "        del base.fc\n        self.base = base\n"),
        ("model = DDP(ReID(10))", "net = ReID(10)\nnet.base.fc = nn.Identity()\nmodel = DDP(net)"),
        ("model = DDP(ReID(10))", "model = DDP(ReID(10), find_unused_parameters=True)"),
        (
            "        self.base = base\n",
            "        base.fc.requires_grad_(False)\n        self.base = base\n",
        ),
        (
            "        self.head = nn.Linear(2048, n)\n",
            "        for p in self.base.parameters():\n            p.requires_grad = False\n",
        ),
        # the whole backbone runs, its fc included
        ("        b = self.base\n", "        return self.base(x)\n        b = self.base\n"),
        # forward reads the head itself
        ("return self.head(x.mean((2, 3)))", "return b.fc(x.mean((2, 3)))"),
    ],
    ids=[
        "identity",
        "deleted",
        "replaced-outside",
        "find-unused",
        "head-frozen",
        "backbone-frozen",
        "whole-model",
        "head-read",
    ],
)
def test_a_backbone_whose_head_is_removed_run_or_allowed_is_quiet(change):
    old, new = change
    assert old in BACKBONE
    assert reported_lines(BACKBONE.replace(old, new)) == []


TIMM_FEATURES = """
import timm


class SimCLR(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=False, drop_path_rate=0.1)
        self.projector = nn.Linear(self.backbone.embed_dim, 128)

    def encode(self, x):
        return self.backbone.forward_features(x)[:, 0]

    def forward(self, x):
        return self.projector(self.encode(x))


model = DDP(SimCLR("vit_small_patch16_224"))
"""


def test_a_timm_model_run_for_its_features_keeps_an_unused_classifier():
    """Blind set bh's 13: create_model keeps its 1000-class head; forward_features skips it."""
    assert reported_lines(TIMM_FEATURES) == [8]


def test_the_modules_own_head_named_like_timms_is_not_the_backbones():
    """Blind set fu's 19: `self.fc = nn.Linear(...)` is the wrapper's own head; the
    backbone's classifier is still there, unused."""
    own_fc = TIMM_FEATURES.replace("self.projector = nn.Linear", "self.fc = nn.Linear").replace(
        "self.projector(", "self.fc("
    )
    assert reported_lines(own_fc) == [8]


@pytest.mark.parametrize(
    "change",
    [
        ("drop_path_rate=0.1)", "drop_path_rate=0.1, num_classes=0)"),
        ("drop_path_rate=0.1)", "drop_path_rate=0.1, features_only=True)"),
        (
            "        self.projector =",
            "        self.backbone.reset_classifier(0)\n        self.projector =",
        ),
        (
            "        self.projector =",
            "        self.backbone.head = nn.Identity()\n        self.projector =",
        ),
        ("model = DDP(SimCLR(", "model = DDP(find_unused_parameters=True, module=SimCLR("),
        # the whole model runs, its head included
        ("self.backbone.forward_features(x)[:, 0]", "self.backbone(x)"),
        (
            "self.backbone.forward_features(x)[:, 0]",
            "self.backbone.forward_head(self.backbone.forward_features(x))",
        ),
    ],
    ids=["no-classes", "features-only", "reset", "identity", "find-unused", "whole", "head-run"],
)
def test_a_timm_model_without_a_head_or_run_whole_is_quiet(change):
    old, new = change
    assert old in TIMM_FEATURES
    assert reported_lines(TIMM_FEATURES.replace(old, new)) == []


TIMM_PIECES = """
import timm


class MAE(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = nn.Linear(encoder.embed_dim, 768)

    def forward(self, x):
        enc = self.encoder
        h = enc.blocks(enc.patch_embed(x) + enc.pos_embed[:, 1:])
        return self.decoder(enc.norm(h))


encoder = timm.create_model("vit_base_patch16_224", pretrained=False)
model = DDP(MAE(encoder))
"""


def test_a_timm_model_handed_in_and_run_piece_by_piece_keeps_an_unused_classifier():
    """Blind set dd's 15: MAE runs the encoder's patch_embed, blocks and norm itself."""
    assert reported_lines(TIMM_PIECES) == [17]


@pytest.mark.parametrize(
    "change",
    [
        ("pretrained=False)", "pretrained=False, num_classes=0)"),
        ("return self.decoder(enc.norm(h))", "return self.decoder(enc.head(enc.norm(h)))"),
        ("model = DDP(MAE(encoder))", "model = DDP(MAE(encoder))\nother = MAE(nn.Linear(2, 2))"),
    ],
    ids=["no-classes", "head-run", "another-encoder"],
)
def test_a_timm_model_handed_in_without_a_head_or_with_it_run_is_quiet(change):
    old, new = change
    assert old in TIMM_PIECES
    assert reported_lines(TIMM_PIECES.replace(old, new)) == []


@pytest.mark.slow
def test_an_expert_skipped_when_no_token_reaches_it_fails_under_torchrun_and_its_twin_runs(
    torchrun,
):
    # blind set aw: a mixture of experts under DDP that `continue`s past an expert
    # whose selection is empty; the twin runs it on the empty input
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "expert_skipped_when_no_token_is_routed_to_it.py",
        "Expected to have finished reduction in the prior iteration",
        SCRIPTS / "correct_expert_run_on_an_empty_selection.py",
        "trained 3 steps",
    )


EXPERTS = """
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        def forward(self, x, chosen):
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                idx = (chosen == e).nonzero(as_tuple=True)[0]
                if EMPTY:
                    continue
                out[idx] = expert(x[idx])
            return out

    model = DDP(MoE())
    """


@pytest.mark.parametrize(
    "empty", ["idx.numel() == 0", "len(idx) == 0", "not (chosen == e).any()", "idx.shape[0] < 1"]
)
def test_an_expert_skipped_on_an_empty_selection_is_reported(empty):
    assert reported_lines(EXPERTS.replace("EMPTY", empty)) == [10]


@pytest.mark.parametrize(
    "change",
    [
        {"idx.numel() == 0": "idx.numel() > 0"},  # a test for a non-empty selection
        {"continue": "out = out + 0"},  # the branch leaves nothing out
        # blind set jt's 18 (correct): the idle expert kept in the graph at zero weight
        {
            "continue": "out = out + sum(p.sum() for p in expert.parameters()) * 0.0\n"
            "                    continue"
        },
        {"continue": "out = out + self.experts[e](x[:0]).sum()\n                    continue"},
        {"model = DDP(MoE())": "model = DDP(MoE(), find_unused_parameters=True)"},
    ],
)
def test_a_skip_that_leaves_no_expert_out_or_a_ddp_that_finds_them_is_not_reported(change):
    body = EXPERTS.replace("EMPTY", "idx.numel() == 0")
    for old, new in change.items():
        body = body.replace(old, new)
    assert reported_lines(body) == []


def test_a_member_a_field_of_the_model_picks_is_reported_under_a_strict_ddp():
    # the task being learned, set between tasks: one head per step, the others idle
    body = """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.heads = nn.ModuleList([nn.Linear(4, 2) for _ in range(3)])
                self.task = 0
            def forward(self, x):
                return self.heads[self.task](x)

        model = DDP(Net())
        """
    assert reported_lines(body) == [8]
    assert (
        reported_lines(body.replace("DDP(Net())", "DDP(Net(), find_unused_parameters=True)")) == []
    )


def test_an_expert_picked_by_a_loop_over_token_counts_and_skipped_at_zero_is_reported():
    # blind set ay: `for e, n in enumerate(counts): if n == 0: continue` then `self.experts[e]`
    body = """
        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
            def forward(self, x, chosen):
                counts = torch.bincount(chosen, minlength=4).tolist()
                out, start = torch.zeros_like(x), 0
                for e, n in enumerate(counts):
                    if n == 0:
                        continue
                    out[start:start + n] = self.experts[e](x[start:start + n])
                    start += n
                return out

        model = DDP(MoE())
        """
    assert reported_lines(body) == [10]
    # a count of zero that skips no member: every expert still runs
    assert reported_lines(body.replace("self.experts[e](", "torch.tanh(")) == []


@pytest.mark.parametrize(
    "gate, reported",
    [
        # blind set by's 11: the auxiliary head gated in an expression, switched on the model
        ("aux = self.aux(x) if (self.training and self.use_aux) else None", [15]),
        ("aux = None\n            if self.use_aux:\n                aux = self.aux(x)", [17]),
        ("aux = self.aux(x) if self.training else None", []),  # not switched by the script
    ],
)
def test_a_submodule_under_a_flag_the_loop_switches_on_the_model(gate, reported):
    body = f"""
    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.aux = nn.Linear(4, 1)
            self.use_aux = True
        def forward(self, x):
            {gate}
            return self.body(x), aux

    net = Detector()
    model = DDP(net)
    for epoch in range(10):
        net.use_aux = epoch < 3
        for x in loader:
            out, aux = model(x)
            out.sum().backward()
    """
    assert reported_lines(body) == reported


DISCARDED = SCRIPTS / "output_discarded_by_the_training_step.py"


@pytest.mark.parametrize(
    "second, reported",
    [
        # blind set ce's 11 (correct): DANN's target batch keeps only the domain output,
        # the source batch's call in the same step keeps the label output
        ("_, nsp_logits = model(x)", False),
        ("lm_again, _ = model(x)", True),  # every call of the step throws it away
    ],
)
def test_an_output_another_call_of_the_step_keeps_is_used(second, reported):
    source = DISCARDED.read_text().replace(
        "        lm_logits, _ = model(x)  # expect: unused-parameters\n",
        f"        lm_logits, _ = model(x)\n        {second}\n",
    )
    found = [f for f in lint_source(source) if f.cause_id == "unused-parameters"]
    assert bool(found) == reported


def test_an_output_only_another_loop_keeps_is_left_out_of_this_loops_steps():
    # blind set bl's 12: PPG's policy phase throws away the auxiliary value that only
    # the auxiliary phase, a loop of its own, uses: each policy step leaves it out
    source = DISCARDED.read_text().replace(
        '    print(f"trained rank {dist.get_rank()}")\n',
        "    for _aux in range(2):\n"
        "        _, nsp_logits = model(x)\n"
        "        nsp_logits.sum().backward()\n"
        '    print(f"trained rank {dist.get_rank()}")\n',
    )
    found = [f.line for f in lint_source(source) if f.cause_id == "unused-parameters"]
    assert found == [35, 41]  # and the auxiliary loop leaves lm_head out in turn


# Blind set cm's 05: the auxiliary term joins the loss under a test of an option
# whose default turns it off, in the step itself.
WEIGHTED_HEAD_MODEL = """
import argparse
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.cls = nn.Linear(4, 3)
        self.exist = nn.Linear(4, 2)
    def forward(self, x):
        f = self.body(x)
        return self.cls(f), self.exist(f)

ap = argparse.ArgumentParser()
ap.add_argument("--exist-weight", type=float, default={default})
args = ap.parse_args()
model = DDP(Net(){options})
for x, y, exist in loader:
    cls_out, exist_out = model(x)
    loss = F.cross_entropy(cls_out, y)
    if {test}:
        loss = loss + args.exist_weight * F.binary_cross_entropy_with_logits(exist_out, exist)
    loss.backward()
"""


@pytest.mark.parametrize(
    ("default", "test", "options", "reported"),
    [
        ("0.0", "args.exist_weight > 0", "", [21]),
        ("0", "args.exist_weight", "", [21]),
        ("0.0", "not args.exist_weight <= 0", "", [21]),
        # on by default, allowed, or a test the default does not decide
        ("0.1", "args.exist_weight > 0", "", []),
        ("0.0", "args.exist_weight > 0", ", find_unused_parameters=True", []),
        ("None", "args.exist_weight is not None and args.exist_weight > 0", "", [21]),
        # a test the batch decides too: some steps leave it out (the per-step reading)
        ("0.0", "args.exist_weight > 0 or exist.any()", "", [21]),
    ],
)
def test_a_head_an_option_gate_in_the_step_leaves_out_by_default(default, test, options, reported):
    body = (
        WEIGHTED_HEAD_MODEL.replace("{default}", default)
        .replace("{test}", test)
        .replace("{options}", options)
    )
    found = lint_snippet(HEADER, "import torch.nn.functional as F\n" + body, ["unused-parameters"])
    assert [line for line, _ in found] == reported
    if reported:
        assert "args.exist_weight" in found[0][1].message and "self.exist" in found[0][1].message


# Blind set ds's 05: forward returns a dict of heads, and the step reads the point
# head's entry only under the `else` of an option whose default takes the other way.
ENTRY_MODEL = """
import argparse
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.quantile_head = nn.Linear(4, 3)
        self.point_head = nn.Linear(4, 1)
    def forward(self, x):
        h = self.body(x)
        return {"quantiles": self.quantile_head(h), "point": self.point_head(h)}

ap = argparse.ArgumentParser()
ap.add_argument("--loss", choices=["quantile", "mse"], default={default})
args = ap.parse_args()
model = DDP(Net(){options})
for x, y in loader:
    out = model(x)
    if args.loss == "quantile":
        loss = pinball({first}, y)
    else:
        loss = F.mse_loss({second}, y)
    {extra}loss.backward()
"""


@pytest.mark.parametrize(
    ("default", "first", "second", "options", "extra", "reported"),
    [
        ('"quantile"', 'out["quantiles"]', 'out["point"]', "", "", [20]),
        # the other default: the quantile head is the one left out, read under the `if`
        ('"mse"', 'out["quantiles"]', 'out["point"]', "", "", [20]),
        # allowed, both entries read every step, or the output handed on whole
        ('"quantile"', 'out["quantiles"]', 'out["point"]', ", find_unused_parameters=True", "", []),
        (
            '"quantile"',
            'out["quantiles"]',
            'out["point"]',
            "",
            'loss = loss + out["point"].mean()\n    ',
            [],
        ),
        ('"quantile"', 'out["quantiles"]', 'out["point"]', "", "log(out)\n    ", []),
        # a default the file does not fix: the environment decides
        ('os.environ.get("LOSS", "quantile")', 'out["quantiles"]', 'out["point"]', "", "", []),
    ],
)
def test_an_entry_of_the_output_an_option_default_leaves_out(
    default, first, second, options, extra, reported
):
    body = (
        ENTRY_MODEL.replace("{default}", default)
        .replace("{first}", first)
        .replace("{second}", second)
        .replace("{options}", options)
        .replace("{extra}", extra)
    )
    found = lint_snippet(HEADER, "import torch.nn.functional as F\n" + body, ["unused-parameters"])
    assert [line for line, _ in found] == reported
    if reported:
        head = "self.point_head" if "quantile" in default else "self.quantile_head"
        assert head in found[0][1].message and "args.loss" in found[0][1].message


def test_a_head_read_only_under_the_else_of_an_option_gate_is_left_out_by_default():
    body = WEIGHTED_HEAD_MODEL.replace("{default}", "0.0").replace("{options}", "")
    body = body.replace(
        "    if {test}:\n        loss = loss + args",
        "    if args.exist_weight == 0:\n        pass\n    else:\n        loss = loss + args",
    )
    found = lint_snippet(HEADER, "import torch.nn.functional as F\n" + body, ["unused-parameters"])
    assert [line for line, _ in found] == [21]
    assert "is true" in found[0][1].message and "`else`" in found[0][1].message


# Blind set hv's 01: a supernet's choice block runs the op the sampled path picks.
SUPERNET = """
class ChoiceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    def forward(self, x, choice):
        return self.ops[choice](x)

class Supernet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ChoiceBlock() for _ in range(4)])
    def forward(self, x, arch):
        for block, choice in zip(self.blocks, arch):
            x = block(x, choice)
        return x

model = DDP(Supernet(){options})
for x in loader:
    arch = [random.randrange(3) for _ in range(4)]
    model(x, arch).sum().backward()
"""


@pytest.mark.parametrize(
    ("options", "reported"),
    [("", [7]), (", find_unused_parameters=True", [])],
    ids=["strict", "unused allowed"],
)
def test_a_member_a_block_of_the_model_picks_by_its_input(options, reported):
    assert reported_lines(SUPERNET.replace("{options}", options)) == reported


# Blind set hu's 12: an adapter per hospital, run for the hospitals in the batch.
SITE_ADAPTERS = """
class Net(nn.Module):
    def __init__(self, n_sites):
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.adapters = nn.ModuleList([nn.Linear(8, 1) for _ in range(n_sites)])
    def forward(self, x, site):
        h = self.encoder(x)
        out = h.new_zeros(h.size(0))
        for s in SITES:
            sel = site == s
            out[sel] = self.adapters[s](h[sel]).squeeze(-1)
        return out

model = DDP(Net(6))
for x, site in loader:
    model(x, site).sum().backward()
"""


@pytest.mark.parametrize(
    ("sites", "reported"),
    [
        ("site.unique().tolist()", [12]),
        ("torch.unique(site)", [12]),
        ("range(len(self.adapters))", []),  # every adapter each step
    ],
    ids=["unique values", "torch.unique", "every adapter"],
)
def test_members_picked_by_the_values_present_in_an_input(sites, reported):
    assert reported_lines(SITE_ADAPTERS.replace("SITES", sites)) == reported


# Blind set ig's 01: modality dropout decided by a draw, the frontends run on its flags.
MODALITY_DROPOUT = """
class AVModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Linear(8, 8)
        self.audio = nn.Linear(8, 8)
        self.fusion = nn.Linear(16, 4)
    def forward(self, video, audio):
        use_video = True
        if self.training and random.random() < 0.3:
            use_video = False
        v = self.visual(video) if use_video else video.new_zeros(video.shape)
        if GUARD:
            v = v + self.visual(video)
        return self.fusion(torch.cat([v, self.audio(audio)], -1))

model = DDP(AVModel(){options})
for video, audio in loader:
    model(video, audio).sum().backward()
"""


@pytest.mark.parametrize(
    ("guard", "options", "reported"),
    [
        ("use_video", "", [13]),
        ("use_video", ", find_unused_parameters=True", []),
        ("video.numel() > 0", "", []),  # a flag no draw sets
    ],
    ids=["flag a draw sets", "unused allowed", "another test"],
)
def test_a_submodule_under_a_flag_a_random_draw_sets(guard, options, reported):
    body = MODALITY_DROPOUT.replace("GUARD", guard).replace("{options}", options)
    assert reported_lines(body) == reported
