"""Linear-probe evaluation of a self-supervised ResNet-50 on a downstream dataset.

The downstream dataset only ships a train folder, so 10% of it is held out as a
validation split for choosing the learning rate.  The backbone is frozen; only the
linear classifier is trained (and synchronised with DDP).

    torchrun --nproc_per_node=4 06_linear_probe_split.py --data /datasets/food101/train \
        --pretrained runs/byol_r50/backbone_ep0300.pth --num-classes 101
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser("linear probe")
parser.add_argument("--data", required=True)
parser.add_argument("--pretrained", required=True)
parser.add_argument("--num-classes", type=int, required=True)
parser.add_argument("--val-fraction", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=256, help="per GPU")
parser.add_argument("--lr", type=float, default=0.1, help="base lr per 256 images")
parser.add_argument("--wd", type=float, default=0.0)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--out", default="probe_out")


def load_backbone(path):
    backbone = torchvision.models.resnet50()
    backbone.fc = nn.Identity()
    state = torch.load(path, map_location="cpu")
    if "model" in state:
        state = state["model"]
    cleaned = {}
    for k, v in state.items():
        for prefix in ("module.", "online_encoder.0.", "backbone.", "encoder."):
            if k.startswith(prefix):
                k = k[len(prefix):]
        cleaned[k] = v
    msg = backbone.load_state_dict(cleaned, strict=False)
    assert set(msg.missing_keys) == set(), f"missing keys: {msg.missing_keys}"
    return backbone


class Probe(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.01)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        return self.fc(self.bn(x))


def shard(indices, rank, world):
    return indices[rank::world]


@torch.no_grad()
def evaluate(backbone, probe, loader, device):
    probe.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = backbone(x)
        pred = probe(feats.float()).argmax(1)
        stats[0] += (pred == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (100.0 * stats[0] / stats[1]).item()


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])
    full_train = torchvision.datasets.ImageFolder(args.data, transform=train_tf)
    full_eval = torchvision.datasets.ImageFolder(args.data, transform=eval_tf)

    perm = torch.randperm(len(full_train)).tolist()
    n_val = int(len(perm) * args.val_fraction)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    train_set = Subset(full_train, train_idx)
    val_set = Subset(full_eval, shard(val_idx, rank, world))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    backbone = load_backbone(args.pretrained).to(device).eval()
    for p in backbone.parameters():
        p.requires_grad = False

    probe = Probe(2048, args.num_classes).to(device)
    probe = nn.SyncBatchNorm.convert_sync_batchnorm(probe)
    probe = DDP(probe, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(probe.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_set)} / val {n_val} images, {world} GPUs, lr {lr:.3f}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        probe.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                feats = backbone(x)
            logits = probe(feats.float())
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])

        dist.all_reduce(loss_sum)
        val_acc = evaluate(backbone, probe.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val top-1 {val_acc:.2f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"probe": probe.module.state_dict(), "epoch": epoch, "val_acc": val_acc},
                       os.path.join(args.out, "last.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(probe.module.state_dict(), os.path.join(args.out, "best_probe.pth"))

    if rank == 0:
        print(f"best val top-1 {best_acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
