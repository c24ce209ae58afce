#!/usr/bin/env python3
"""ProtoNet with learned metric scaling (TADAM-style alpha) on CIFAR-FS, with early stopping.

Validation accuracy is averaged over all GPUs; training stops when it has not
improved for --patience epochs.

    torchrun --nproc_per_node=4 14_protonet_cifarfs_earlystop.py --data /data/cifar_fs --out runs/cfs_proto
"""
import argparse
import json
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

LOG = logging.getLogger("cfs")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar_fs")
    p.add_argument("--out", default="runs/cfs_proto")
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=5)
    p.add_argument("--query", type=int, default=15)
    p.add_argument("--train-way", type=int, default=15)
    p.add_argument("--max-epochs", type=int, default=300)
    p.add_argument("--patience", type=int, default=20)
    p.add_argument("--episodes", type=int, default=400, help="per epoch, across all GPUs")
    p.add_argument("--val-episodes", type=int, default=1000, help="across all GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--alpha-init", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CIFARFS(Dataset):
    def __init__(self, root, split, aug):
        with open(os.path.join(root, f"CIFAR_FS_{split}.pickle"), "rb") as f:
            d = pickle.load(f, encoding="latin1")
        self.x = d["data"]
        uniq = sorted(set(d["labels"]))
        m = {c: i for i, c in enumerate(uniq)}
        self.y = np.array([m[c] for c in d["labels"]], dtype=np.int64)
        norm = T.Normalize([0.507, 0.487, 0.441], [0.267, 0.256, 0.276])
        ops = [T.ToPILImage()]
        if aug:
            ops += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
        self.tf = T.Compose(ops + [T.ToTensor(), norm])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.tf(self.x[i]), self.y[i]


class FixedCountEpisodes:
    """n episodes per rank; class-minor layout [k0c0, k0c1, ..]."""

    def __init__(self, y, n, way, per, seed):
        self.pos = [np.flatnonzero(y == c) for c in range(int(y.max()) + 1)]
        self.n, self.way, self.per = n, way, per
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            cls = self.rng.choice(len(self.pos), self.way, replace=False)
            sel = [self.rng.choice(self.pos[c], self.per, replace=False) for c in cls]
            yield np.stack(sel, axis=1).ravel().tolist()


class Conv4Wide(nn.Module):
    def __init__(self, widths=(64, 96, 128, 256)):
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2)]
            cin = w
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).flatten(1)


class ScaledProto(nn.Module):
    def __init__(self, alpha_init):
        super().__init__()
        self.backbone = Conv4Wide()
        self.log_alpha = nn.Parameter(torch.tensor(float(np.log(alpha_init))))

    def forward(self, x, way, shot):
        z = self.backbone(x)
        s, q = z[: way * shot], z[way * shot:]
        protos = s.view(shot, way, -1).mean(0)
        return -self.log_alpha.exp() * torch.cdist(q, protos).pow(2)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tr, va = CIFARFS(args.data, "train", True), CIFARFS(args.data, "val", False)
    tr_dl = DataLoader(tr, num_workers=args.workers, pin_memory=True, persistent_workers=True,
                       batch_sampler=FixedCountEpisodes(tr.y, args.episodes // world, args.train_way,
                                                        args.shot + args.query, seed=args.seed + 101 * rank))
    va_dl = DataLoader(va, num_workers=args.workers, pin_memory=True,
                       batch_sampler=FixedCountEpisodes(va.y, args.val_episodes // world, args.way,
                                                        args.shot + args.query, seed=55 + rank))

    model = DDP(ScaledProto(args.alpha_init).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=8)
    ytr = torch.arange(args.train_way, device=dev).repeat(args.query)
    yva = torch.arange(args.way, device=dev).repeat(args.query)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump(vars(args), open(os.path.join(args.out, "args.json"), "w"), indent=2)
    best, bad_epochs, history = 0.0, 0, []

    for epoch in range(args.max_epochs):
        t0 = time.time()
        model.train()
        acc_train = torch.zeros(3, device=dev)
        for x, _ in tr_dl:
            logits = model(x.to(dev, non_blocking=True), args.train_way, args.shot)
            loss = F.cross_entropy(logits, ytr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc_train += torch.stack([loss.detach(), (logits.argmax(1) == ytr).float().mean(), torch.ones_like(loss)])

        model.eval()
        acc_val = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, _ in va_dl:
                logits = model(x.to(dev, non_blocking=True), args.way, args.shot)
                acc_val += torch.stack([(logits.argmax(1) == yva).float().mean(), torch.ones((), device=dev)])
        dist.all_reduce(acc_train)
        dist.all_reduce(acc_val)
        val_acc = (acc_val[0] / acc_val[1]).item()
        sched.step(val_acc)

        if rank == 0:
            history.append({"epoch": epoch, "loss": (acc_train[0] / acc_train[2]).item(),
                            "train_acc": (acc_train[1] / acc_train[2]).item(), "val_acc": val_acc})
            LOG.info("epoch %3d loss %.4f train %.4f val %.4f alpha %.3f lr %.1e (%.0fs)", epoch,
                     history[-1]["loss"], history[-1]["train_acc"], val_acc,
                     model.module.log_alpha.exp().item(), opt.param_groups[0]["lr"], time.time() - t0)
            if val_acc > best:
                best, bad_epochs = val_acc, 0
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_acc": val_acc},
                           os.path.join(args.out, "best.pth"))
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    LOG.info("no improvement for %d epochs, stopping", args.patience)
                    break

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
        LOG.info("best val acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
