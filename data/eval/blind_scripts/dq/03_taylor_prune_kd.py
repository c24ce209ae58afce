#!/usr/bin/env python
"""Channel pruning (first-order Taylor importance, global ranking) of a compact
VGG-style backbone for the doorbell camera, followed by KD fine-tuning from the
unpruned model.

torchrun --nproc_per_node=8 03_taylor_prune_kd.py --config configs/prune_cam_v3.yaml
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


DEFAULTS = dict(
    data_root="/mnt/datasets/cam_v3",
    base_ckpt="weights/camnet_v3_base.pth",
    channels=[32, 64, 64, 128, 128, 256, 256, 512],
    num_classes=12,
    prune_ratio=0.5,
    calib_batches=64,
    epochs=40,
    batch_size=96,
    lr=0.02,
    temperature=3.0,
    kd_alpha=0.8,
    workers=8,
    out_dir="runs/camnet_v3_pruned",
)


def conv_bn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CamNet(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.channels = list(channels)
        layers, cin = [], 3
        for i, c in enumerate(channels):
            layers.append(conv_bn(cin, c, 2 if i in (0, 2, 4, 6) else 1))
            cin = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def taylor_importance(model, loader, device, num_batches):
    """|activation * grad| averaged over spatial dims and batches, per output channel."""
    acts, scores = {}, {}
    hooks = []
    for i, block in enumerate(model.features):
        def fwd_hook(m, inp, out, i=i):
            out.retain_grad()
            acts[i] = out
        hooks.append(block[2].register_forward_hook(fwd_hook))
        scores[i] = torch.zeros(block[1].num_features, device=device)

    model.train()
    for b, (x, y) in enumerate(loader):
        if b >= num_batches:
            break
        x, y = x.to(device), y.to(device)
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for i, a in acts.items():
            scores[i] += (a * a.grad).mean(dim=(2, 3)).abs().sum(0)
    for h in hooks:
        h.remove()
    model.zero_grad()
    return {i: s / num_batches for i, s in scores.items()}


def prune_channels(model, scores, ratio):
    """Keep the globally most important channels; build a smaller CamNet with copied weights."""
    flat = torch.cat([s / (s.norm() + 1e-8) for s in scores.values()])
    threshold = flat.sort().values[int(ratio * flat.numel())]
    keep = {}
    for i, s in scores.items():
        s = s / (s.norm() + 1e-8)
        idx = (s >= threshold).nonzero().flatten()
        if idx.numel() < 8:
            idx = s.topk(8).indices.sort().values
        keep[i] = idx

    new_channels = [keep[i].numel() for i in range(len(model.features))]
    pruned = CamNet(new_channels, model.fc.out_features).to(next(model.parameters()).device)
    prev = torch.arange(3, device=flat.device)
    for i, (old, new) in enumerate(zip(model.features, pruned.features)):
        k = keep[i]
        new[0].weight.data.copy_(old[0].weight.data[k][:, prev])
        for attr in ("weight", "bias", "running_mean", "running_var"):
            getattr(new[1], attr).data.copy_(getattr(old[1], attr).data[k])
        prev = k
    pruned.fc.weight.data.copy_(model.fc.weight.data[:, prev])
    pruned.fc.bias.data.copy_(model.fc.bias.data)
    return pruned


def kd_criterion(s, t, y, T, alpha):
    kd = F.kl_div(F.log_softmax(s / T, 1), F.softmax(t / T, 1), reduction="batchmean") * T * T
    return alpha * kd + (1 - alpha) * F.cross_entropy(s, y)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        total[0] += (model(x).argmax(1) == y).sum()
        total[1] += y.size(0)
    dist.all_reduce(total)
    return (100.0 * total[0] / total[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cli = parser.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    norm = transforms.Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(160, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.3, 0.3, 0.3),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(176), transforms.CenterCrop(160),
                                 transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(cfg["data_root"], "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(cfg["data_root"], "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=256, num_workers=cfg["workers"], pin_memory=True)

    base = CamNet(cfg["channels"], cfg["num_classes"])
    base.load_state_dict(torch.load(cfg["base_ckpt"], map_location="cpu"))
    base.to(device)

    # teacher = frozen copy of the unpruned network
    teacher = copy.deepcopy(base).eval()
    for p in teacher.parameters():
        p.requires_grad = False

    train_sampler.set_epoch(0)
    scores = taylor_importance(base, train_loader, device, cfg["calib_batches"])
    student = prune_channels(base, scores, cfg["prune_ratio"])
    del base
    if rank == 0:
        print("pruned channels:", student.channels, flush=True)

    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    student = DDP(student, device_ids=[local_rank])

    lr = cfg["lr"] * cfg["batch_size"] * world / 256
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])

    os.makedirs(cfg["out_dir"], exist_ok=True)
    best = -1.0
    for epoch in range(cfg["epochs"]):
        student.train()
        train_sampler.set_epoch(epoch + 1)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t = teacher(x)
            s = student(x)
            loss = kd_criterion(s, t, y, cfg["temperature"], cfg["kd_alpha"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it} loss {loss.item():.4f}", flush=True)
        sched.step()

        acc = evaluate(student.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.2f}", flush=True)
            state = {"channels": student.module.channels, "state_dict": student.module.state_dict(),
                     "epoch": epoch, "acc": acc}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(cfg["out_dir"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
