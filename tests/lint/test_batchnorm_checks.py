"""BatchNorm under DDP: a model called twice before one backward while DDP
broadcasts its buffers (ddp-broadcast-buffers-inplace), and plain BatchNorm
over a few samples per GPU (batchnorm-not-synced)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "gan_batchnorm_discriminator_called_twice.py"
FIXED = SCRIPTS / "correct_gan_discriminator_without_buffer_broadcast.py"
INPLACE_ERROR = "modified by an inplace operation"

HEADER = """
import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    def forward(self, x):
        return self.net(x)
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["ddp-broadcast-buffers-inplace"])]


def sync_preserves_version_counters() -> bool:
    """The installed torch's DDP keeps the buffers' version counters while it
    broadcasts them (pytorch/pytorch#175851): two forwards then train."""
    from torch.nn.parallel import DistributedDataParallel

    return "_unsafe_preserve_version_counter" in inspect.getsource(
        DistributedDataParallel._sync_buffers
    )


@pytest.mark.slow
def test_the_fixture_fails_only_on_a_torch_without_the_fix_and_its_twin_runs(torchrun):
    """The finding says the error depends on the PyTorch release: so does the run."""
    wait_broken, wait_fixed = torchrun.start(BROKEN), torchrun.start(FIXED)
    broken = wait_broken()
    if sync_preserves_version_counters():
        assert broken.returncode == 0, broken.stderr[-2000:]
        assert broken.stdout.count("trained rank") == 2
    else:
        assert broken.returncode != 0
        assert INPLACE_ERROR in broken.stderr
    fixed = wait_fixed()
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("trained rank") == 2


def test_two_views_of_a_torchvision_resnet_inside_autocast_are_reported():
    lines = reported_lines(
        """
        model = DDP(torchvision.models.resnet18().cuda(), device_ids=[0])
        for v1, v2 in loader:
            with torch.autocast("cuda"):
                z1 = model(v1)
                z2 = model(v2)
            scaler.scale(loss_fn(z1, z2)).backward()
        """
    )
    assert lines == [6]


@pytest.mark.parametrize(
    "choices, reported",
    [
        # blind set aj's 17: the architecture picked by name among BatchNorm models
        ('["resnet18", "resnet50"]', [7]),
        # a name among models with LayerNorm too: not known to build BatchNorm
        ('["resnet18", "vit_b_16"]', []),
    ],
)
def test_a_torchvision_model_picked_by_name_is_judged_by_the_names_the_file_offers(
    choices, reported
):
    body = f"""
    parser.add_argument("--arch", default="resnet18", choices={choices})
    net = getattr(torchvision.models, args.arch)(num_classes=10).cuda()
    model = DDP(net, device_ids=[0])
    for clean, aug in loader:
        logits_clean = model(clean)
        logits_aug = model(aug)
        (logits_clean - logits_aug).pow(2).mean().backward()
    """
    assert reported_lines(body) == reported


def test_a_model_built_through_a_helper_and_a_self_field_is_reported():
    lines = reported_lines(
        """
        def build():
            return Disc()

        class Trainer:
            def __init__(self):
                self.d = DDP(build())
            def step(self, real, fake):
                loss = self.d(real).mean() - self.d(fake).mean()
                loss.backward()
        """
    )
    assert lines == [9]


@pytest.mark.parametrize(
    "norm, reported",
    [
        # blind set bn's 12: MinkowskiEngine's BatchNorm keeps running statistics too
        ("ME.MinkowskiBatchNorm(8)", [13]),
        ("timm.layers.BatchNormAct2d(8)", [13]),
        # synchronised or frozen layers of the libraries: nothing to report here
        ("ME.MinkowskiSyncBatchNorm(8)", []),
        ("torchvision.ops.FrozenBatchNorm2d(8)", []),
    ],
)
def test_a_libraries_batchnorm_layer_is_one_too(norm, reported):
    """Two clouds of a pair through one DDP model before backward (FCGF-style)."""
    body = f"""
    import MinkowskiEngine as ME
    import timm

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), {norm})

    model = DDP(Encoder().cuda(), device_ids=[0])
    for s0, s1 in loader:
        f0 = model(s0)
        f1 = model(s1)
        contrastive(f0, f1).backward()
    """
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    "backbone, reported",
    [
        ("torchvision.models.resnet50()", [9]),
        # blind set by's 09: DETR's backbone built with frozen BatchNorm
        ("torchvision.models.resnet50(norm_layer=torchvision.ops.FrozenBatchNorm2d)", []),
        ("torchvision.models.resnet50(norm_layer=nn.SyncBatchNorm)", []),
        ("torchvision.models.resnet50(norm_layer=nn.BatchNorm2d)", [9]),
    ],
)
def test_a_torchvision_model_told_its_norm_layer_has_that_norm(backbone, reported):
    body = f"""
    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = {backbone}

    model = DDP(Detector().cuda(), device_ids=[0])
    for a, b in loader:
        loss = model(a).sum() + model(b).sum()
        loss.backward()
    """
    assert reported_lines(body) == reported


@pytest.mark.parametrize(
    "body",
    [
        # told not to broadcast, or a SyncBatchNorm conversion
        "D = DDP(Disc(), broadcast_buffers=False)\nloss = D(a).mean() + D(b).mean()\nloss.backward()",
        (
            "D = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(Disc()))\n"
            "loss = D(a).mean() + D(b).mean()\nloss.backward()"
        ),
        # options DDP may take from elsewhere
        "D = DDP(Disc(), **ddp_options)\nloss = D(a).mean() + D(b).mean()\nloss.backward()",
        # no BatchNorm in the model
        (
            "D = DDP(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))\n"
            "loss = D(a).mean() + D(b).mean()\nloss.backward()"
        ),
        # a backward between the two calls
        "D = DDP(Disc())\nD(a).mean().backward()\nD(b).mean().backward()",
        # the first call saves nothing for backward
        "D = DDP(Disc())\nwith torch.no_grad():\n    t = D(a)\nD(b).mean().backward()",
        "D = DDP(Disc())\nt = D(a).detach()\n(D(b) - t).mean().backward()",
        # one call or the other, never both
        "D = DDP(Disc())\nif real:\n    out = D(a)\nelse:\n    out = D(b)\nout.mean().backward()",
        # the module called by its own name goes around DDP
        "net = Disc()\nD = DDP(net)\nloss = net(a).mean() + net(b).mean()\nloss.backward()",
        # blind set ed's 18: a backward chained on a loss made of the first call
        (
            "D = DDP(Disc())\nwith D.no_sync():\n    F.cross_entropy(D(a), y).backward()\n"
            "loss = F.cross_entropy(D(b), y)\nloss.backward()"
        ),
    ],
    ids=[
        "no-broadcast",
        "syncbn",
        "options",
        "no-batchnorm",
        "backward-between",
        "first-under-no-grad",
        "first-detached",
        "two-arms",
        "unwrapped-module",
        "chained-backward-first",
    ],
)
def test_quiet_where_nothing_moves_a_saved_buffer(body: str):
    assert reported_lines(body) == []


def unsynced_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["batchnorm-not-synced"])]


def test_a_monai_unet_with_batch_norm_and_two_crops_per_gpu_is_reported():
    lines = unsynced_lines(
        """
        import argparse
        from monai.networks.nets import UNet
        from monai.networks.layers import Norm
        parser = argparse.ArgumentParser()
        parser.add_argument("--batch-size", type=int, default=2)
        args = parser.parse_args()
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds))
        net = UNet(spatial_dims=3, in_channels=4, out_channels=3, channels=(16, 32), strides=(2,), norm=Norm.BATCH)
        model = DDP(net.cuda(), device_ids=[0])
        """
    )
    assert lines == [10]


@pytest.mark.parametrize(
    ("model", "reported"),
    [
        # blind set hr's 17: a Unet decoder is BatchNorm whatever the encoder
        ('smp.Unet("efficientnet-b5", classes=3)', [4]),
        ('smp.DeepLabV3Plus("resnet50", classes=3)', [4]),
        ('smp.Unet("resnet34", classes=3, decoder_use_batchnorm=False)', []),
        ('smp.FPN("mit_b2", classes=3)', []),  # a GroupNorm decoder, a LayerNorm encoder
    ],
    ids=["Unet", "DeepLabV3Plus", "Unet told no BatchNorm", "FPN"],
)
def test_a_segmentation_models_pytorch_model_with_a_batchnorm_decoder(model, reported):
    lines = unsynced_lines(
        f"""
        import segmentation_models_pytorch as smp
        train_loader = DataLoader(ds, 2, shuffle=True)
        model = DDP({model}.cuda())
        """
    )
    assert lines == reported


def test_a_torchvision_deeplab_with_a_literal_batch_of_two_is_reported():
    lines = unsynced_lines(
        """
        from torchvision.models.segmentation import deeplabv3_resnet101
        train_loader = DataLoader(ds, 2, shuffle=True)
        model = DDP(deeplabv3_resnet101(weights=None).cuda())
        """
    )
    assert lines == [4]


@pytest.mark.parametrize(
    ("batch", "reported"),
    [
        # blind set dt's 02: an entry of the file's own config dict
        ('settings["samples_per_gpu"]', [5]),
        # blind set dv's 02: a config read with the file's default
        ('loaded.get("batch_size", 2)', [5]),
        ('loaded.get("batch_size", 32)', []),
        ('loaded["batch_size"]', []),  # a loaded config: the run's choice
    ],
)
def test_a_config_dicts_entry_or_a_get_default_is_a_per_gpu_size(batch, reported):
    body = f"""
        settings = dict(lr=0.01, samples_per_gpu=2)
        loaded = yaml.safe_load(open("run.yaml"))
        loader = DataLoader(ds, batch_size={batch}, sampler=DistributedSampler(ds))
        model = DDP(Disc())
        """
    assert unsynced_lines(body) == reported


@pytest.mark.parametrize(
    ("batch", "reported"),
    [
        # blind set da's 06: a @dataclass config's default, nothing overrides it
        ("cfg.batch_size", [10]),
        # blind set cs's 18: a global batch of 8 divided over the processes
        ("max(1, cfg.global_batch // world)", [10]),
        ("cfg.global_batch // dist.get_world_size()", [10]),
        # a global batch of 64 divided: 32 or fewer per process, not a few
        ("max(1, 64 // world)", []),
    ],
)
def test_a_config_default_or_a_divided_global_batch_is_a_per_gpu_size(batch, reported):
    body = f"""
        @dataclass
        class Config:
            batch_size: int = 2
            global_batch: int = 8

        cfg = Config()
        world = dist.get_world_size()
        loader = DataLoader(ds, batch_size={batch}, sampler=DistributedSampler(ds))
        model = DDP(Disc())
        """
    assert unsynced_lines(body) == reported


@pytest.mark.parametrize(
    "body",
    [
        # enough samples per GPU
        "loader = DataLoader(ds, batch_size=32, shuffle=True)\nmodel = DDP(Disc())",
        # SyncBatchNorm behind a flag: the author chose
        (
            "loader = DataLoader(ds, batch_size=2, shuffle=True)\nnet = Disc()\n"
            "if args.sync_bn:\n    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)\nmodel = DDP(net)"
        ),
        # only an evaluation loader, or a fixed-order one (Fisher, saliency)
        "val_loader = DataLoader(ds, batch_size=1, shuffle=True)\nmodel = DDP(Disc())",
        "loader = DataLoader(ds, batch_size=1, shuffle=False)\nmodel = DDP(Disc())",
        # no BatchNorm: LayerNorm, or torchvision's detection models (frozen BatchNorm)
        "loader = DataLoader(ds, batch_size=2, shuffle=True)\nmodel = DDP(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))",
        (
            "loader = DataLoader(ds, batch_size=2, shuffle=True)\n"
            "model = DDP(torchvision.models.detection.fasterrcnn_resnet50_fpn())"
        ),
        # a batch size the file does not fix
        "loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True)\nmodel = DDP(Disc())",
    ],
    ids=[
        "large-batch",
        "syncbn-flag",
        "val-loader",
        "fixed-order",
        "layernorm",
        "detection",
        "unknown-size",
    ],
)
def test_quiet_where_batch_norm_sees_enough_or_is_synced(body: str):
    assert unsynced_lines(body) == []


LIGHTNING_SEG = """
import argparse
import lightning.pytorch as pl
from torchvision.models.segmentation import deeplabv3_resnet50
from torch.utils.data import DataLoader
parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
args = parser.parse_args()
class Seg(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = deeplabv3_resnet50(weights=None)
loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
pl.Trainer(devices=DEVICES, strategy="ddp"SYNC).fit(Seg(), loader)
"""


@pytest.mark.parametrize(
    ("devices", "sync", "reported"),
    [
        ("8", "", [14]),
        ("8", ", sync_batchnorm=False", [14]),
        ("8", ", sync_batchnorm=True", []),
        ("8", ", sync_batchnorm=args.sync_bn", []),  # the author chose, behind a flag
        ("1", "", []),  # one process: nothing to synchronise
    ],
)
def test_lightning_ddp_over_batchnorm_with_two_samples_per_gpu(devices, sync, reported):
    source = LIGHTNING_SEG.replace("DEVICES", devices).replace("SYNC", sync)
    assert [line for line, _ in lint_snippet("", source, ["batchnorm-not-synced"])] == reported


KEPT_IN_EVAL = """
class BEV(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.layer1)
        self.head = nn.Conv2d(256, 2, 1)

    def train(self, mode=True):
        super().train(mode)
        for m in self.backbone.modules():
            if isinstance(m, KIND):
                m.eval()
        return self


loader = DataLoader(ds, batch_size=2, shuffle=True)
model = DDP(BEV().cuda())
"""


@pytest.mark.parametrize(
    "kind, reported",
    [
        # blind set cl's 04, 09, 12 (and cj's 07): the BatchNorm layers kept in eval
        # mode while the model trains use their running statistics, not the batch's
        ("nn.BatchNorm2d", []),
        ("(nn.BatchNorm1d, nn.BatchNorm2d)", []),
        ("nn.modules.batchnorm._BatchNorm", []),
        ("nn.Dropout", [18]),  # another layer kept in eval: the BatchNorm still trains
    ],
)
def test_batch_norm_kept_in_eval_mode_while_training_needs_no_sync(kind, reported):
    assert unsynced_lines(KEPT_IN_EVAL.replace("KIND", kind)) == reported


SAME_NAME_ELSEWHERE = """
def encoder():
    net = torchvision.models.resnet50()
    return net


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1024, 2)


def main():
    features = encoder().cuda().eval()
    net = MODEL
    model = DDP(net)
    loader = DataLoader(ds, batch_size=1, shuffle=True)
"""


@pytest.mark.parametrize(
    "model, reported",
    [
        # blind set cv's 02: another function's `net` (a frozen feature extractor)
        # is not the model main wraps
        ("Head().cuda()", []),
        ("torchvision.models.resnet18().cuda()", [16]),
    ],
)
def test_a_name_the_wrap_reads_is_judged_by_its_own_functions_values(model, reported):
    assert unsynced_lines(SAME_NAME_ELSEWHERE.replace("MODEL", model)) == reported


@pytest.mark.slow
def test_sync_batchnorm_on_the_cpu_fails_under_torchrun_and_plain_batchnorm_trains(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "sync_batchnorm_on_the_cpu_under_gloo.py",
        "SyncBatchNorm layers only work with GPU modules",
        SCRIPTS / "correct_plain_batchnorm_on_the_cpu_under_gloo.py",
        "trained",
    )


CPU_RUN = """
import torch
import torch.distributed as dist
from torch import nn
dist.init_process_group(BACKEND)
model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)))
DEVICE
"""


@pytest.mark.parametrize(
    ("backend", "device", "reported"),
    [
        # blind set fw's 18: a CPU partition's run over gloo
        ('"gloo"', "model = model.to('cpu')", [6]),
        # a GPU somewhere in the file, a backend the run chooses, or NCCL
        ('"gloo"', "model = model.cuda()", []),
        ('"gloo"', "device = 'cuda' if torch.cuda.is_available() else 'cpu'", []),
        ("args.backend", "model = model.to('cpu')", []),
        ('"nccl"', "pass", []),
    ],
    ids=["cpu", "cuda-model", "cuda-if-available", "backend-option", "nccl"],
)
def test_sync_batchnorm_in_a_run_on_the_cpu(backend, device, reported):
    source = CPU_RUN.replace("BACKEND", backend).replace("DEVICE", device)
    found = lint_snippet("", source, ["syncbn-without-process-group"])
    assert [line for line, _ in found] == reported
