"""BatchBALD-lite on Tiny-ImageNet: BALD scores from MC dropout, top-k per round.

Training of each round is data-parallel over all GPUs; pool scoring (T stochastic
passes per image, 100k images) is sharded over the same GPUs.

    torchrun --standalone --nproc_per_node=8 19_bald_tinyimagenet.py \
        --root /data/tiny-imagenet-200 --rounds 10 --mc 10
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
from torchvision.models import resnet18

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
MEAN, STD = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="./results/bald_tin")
    p.add_argument("--init_size", type=int, default=10000)
    p.add_argument("--budget", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch", type=int, default=512, help="global")
    p.add_argument("--lr", type=float, default=0.2, help="for the global batch")
    p.add_argument("--mc", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class DropoutResNet(nn.Module):
    def __init__(self, n_classes=200, p=0.3):
        super().__init__()
        r = resnet18(num_classes=n_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        self.fc = r.fc
        r.fc = nn.Identity()
        self.trunk = r
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc(self.drop(self.trunk(x)))


@torch.no_grad()
def bald(net, dataset, pool, T, rank, world):
    sub = Subset(dataset, pool)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=500, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    net.drop.train()  # MC dropout on the classifier input only
    out = []
    for x, _ in loader:
        h = net.trunk(x.to(DEVICE, non_blocking=True))
        p = torch.stack([F.softmax(net.fc(net.drop(h)), dim=1) for _ in range(T)])
        pm = p.mean(0)
        entropy_of_mean = -(pm * torch.log(pm + 1e-10)).sum(1)
        mean_entropy = -(p * torch.log(p + 1e-10)).sum(2).mean(0)
        out.append(entropy_of_mean - mean_entropy)
    scores = torch.cat(out)
    pos = torch.tensor(list(sampler), device=scores.device)
    s_all = [torch.empty_like(scores) for _ in range(world)]
    p_all = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(s_all, scores)
    dist.all_gather(p_all, pos)
    full = torch.full((len(pool),), -1.0, device=scores.device)
    full[torch.cat(p_all)] = torch.cat(s_all)
    return full


@torch.no_grad()
def top1(net, loader, device):
    net.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        t[0] += (net(x.to(device)).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose([transforms.RandomCrop(64, padding=8), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.ToTensor(), norm])
    # val/ reorganised into class folders beforehand (val_annotations.txt)
    train_set = datasets.ImageFolder(os.path.join(args.root, "train"), transform=train_tf)
    pool_set = datasets.ImageFolder(os.path.join(args.root, "train"), transform=eval_tf)
    val_set = datasets.ImageFolder(os.path.join(args.root, "val"), transform=eval_tf)
    val_loader = DataLoader(val_set, batch_size=500, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    perm = np.random.default_rng(args.seed).permutation(len(train_set)).tolist()
    labelled, pool = perm[:args.init_size], perm[args.init_size:]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    records = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(DropoutResNet(p=args.dropout)).to(device)
        model = DDP(net, device_ids=[local_rank])
        sub = Subset(train_set, labelled)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed)
        loader = DataLoader(sub, batch_size=args.batch // world, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader), pct_start=0.15)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

        acc = top1(net, val_loader, device)
        if rank == 0:
            records.append({"round": rnd, "n": len(labelled), "val_top1": acc, "min": (time.time() - t0) / 60})
            print(records[-1], flush=True)
            json.dump(records, open(os.path.join(args.out, "records.json"), "w"), indent=2)
            torch.save({"model": net.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.out, "model_last.pt"))
        if rnd == args.rounds:
            break

        scores = bald(net, pool_set, pool, args.mc, rank, world)
        pick = torch.topk(scores, args.budget).indices.tolist()
        pick_set = set(pick)
        labelled += [pool[j] for j in pick]
        pool = [q for j, q in enumerate(pool) if j not in pick_set]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
