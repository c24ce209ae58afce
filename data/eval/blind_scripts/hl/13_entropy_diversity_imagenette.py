"""Uncertainty + diversity active learning on Imagenette (10 ImageNet classes).

Acquisition: take the `pre_factor * budget` highest-entropy pool images, then pick
`budget` of them by farthest-point sampling in a normalised 128-d embedding space.

    torchrun --standalone --nproc_per_node=4 13_entropy_diversity_imagenette.py \
        --train_dir /data/imagenette2-320/train --val_dir /data/imagenette2-320/val
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import ResNet50_Weights, resnet50


class ALNet(nn.Module):
    def __init__(self, num_classes=10, emb_dim=128):
        super().__init__()
        backbone = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.classifier = nn.Linear(feat_dim, num_classes)
        self.proj = nn.Sequential(nn.Linear(feat_dim, 512), nn.ReLU(inplace=True), nn.Linear(512, emb_dim))

    def forward(self, x):
        return self.classifier(self.backbone(x))

    @torch.no_grad()
    def scores_and_embedding(self, x):
        h = self.backbone(x)
        p = F.softmax(self.classifier(h), dim=1)
        ent = -(p * p.clamp_min(1e-12).log()).sum(1)
        return ent, F.normalize(self.proj(h), dim=1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--val_dir", required=True)
    ap.add_argument("--out", default="./runs/imagenette_ent_div")
    ap.add_argument("--init_size", type=int, default=200)
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--pre_factor", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch_per_gpu", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01, help="for 4 x 32 images")
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def farthest_point(emb, k, start):
    chosen = [start]
    dist_min = 1.0 - emb @ emb[start]
    for _ in range(k - 1):
        nxt = int(torch.argmax(dist_min))
        chosen.append(nxt)
        dist_min = torch.minimum(dist_min, 1.0 - emb @ emb[nxt])
    return chosen


def gather_cat(t, world):
    bufs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


@torch.no_grad()
def acquire(net, dataset, pool, args, device, rank, world):
    sub = Subset(dataset, pool)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=128, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    ents, embs = [], []
    for x, _ in loader:
        e, z = net.scores_and_embedding(x.to(device, non_blocking=True))
        ents.append(e)
        embs.append(z)
    ent = gather_cat(torch.cat(ents), world)
    emb = gather_cat(torch.cat(embs), world)
    pos = gather_cat(torch.tensor(list(sampler), device=device), world)
    # drop the samples DistributedSampler repeated to even out the shards
    keep = torch.zeros(len(pool), dtype=torch.long, device=device)
    keep[pos] = torch.arange(len(pos), device=device)
    ent, emb = ent[keep], emb[keep]
    n_pre = min(args.pre_factor * args.budget, len(pool))
    cand = torch.topk(ent, n_pre).indices
    sel = farthest_point(emb[cand], min(args.budget, n_pre), start=0)
    return [pool[int(cand[j])] for j in sel]


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device, non_blocking=True)
        s[0] += (net(x.to(device, non_blocking=True)).argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(args.train_dir, transform=train_tf)
    pool_view = datasets.ImageFolder(args.train_dir, transform=eval_tf)
    val_set = datasets.ImageFolder(args.val_dir, transform=eval_tf)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    perm = np.random.RandomState(args.seed).permutation(len(train_set)).tolist()
    labelled, pool = perm[:args.init_size], perm[args.init_size:]
    log = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(ALNet()).to(device)
        model = DDP(net, device_ids=[local_rank])
        sub = Subset(train_set, labelled)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        acc = validate(net, val_loader, device)
        if rank == 0:
            log.append({"round": rnd, "n_labelled": len(labelled), "val_acc": acc, "sec": int(time.time() - t0)})
            print(log[-1], flush=True)
            with open(os.path.join(args.out, "log.json"), "w") as f:
                json.dump(log, f, indent=2)
            torch.save({"model": net.state_dict(), "labelled": labelled}, os.path.join(args.out, "last.pt"))
        if rnd == args.rounds:
            break

        new = acquire(net, pool_view, pool, args, device, rank, world)
        new_set = set(new)
        labelled += new
        pool = [i for i in pool if i not in new_set]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
