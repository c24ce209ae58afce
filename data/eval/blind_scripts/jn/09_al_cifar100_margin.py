"""CIFAR-100 active learning with margin sampling (ResNet-34, CIFAR stem).

A held-out validation split of the training set is used for model selection;
the official test set is only evaluated once per round.

    torchrun --standalone --nproc_per_node=8 09_al_cifar100_margin.py --cfg configs/c100_margin.yaml
"""
import argparse
import json
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    data_root="/datasets/cifar100",
    out_dir="/shared/al/c100_margin",
    val_size=5000,
    init_size=5000,
    query_size=2500,
    rounds=8,
    epochs=120,
    batch_size=128,      # per GPU
    lr=0.1,              # for 8 GPUs x 128
    weight_decay=5e-4,
    workers=4,
    seed=2024,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    if a.seed is not None:
        cfg["seed"] = a.seed
    return argparse.Namespace(**cfg)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def resnet34_cifar(num_classes=100):
    net = torchvision.models.resnet34(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def predict_probs(net, ds, idx, device, world, rank):
    """Softmax outputs for ds[idx]; result is identical on all ranks."""
    n = len(idx)
    per = (n + world - 1) // world
    part = idx[rank * per:(rank + 1) * per]
    loader = DataLoader(Subset(ds, part.tolist()), batch_size=1000, num_workers=4, pin_memory=True)
    net.eval()
    buf = torch.zeros(per, 100, device=device)
    off = 0
    for x, _ in loader:
        p = F.softmax(net(x.to(device, non_blocking=True)), 1)
        buf[off:off + len(p)] = p
        off += len(p)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return torch.cat(out)[:n]


def accuracy(net, ds, idx, device, world, rank):
    probs = predict_probs(net, ds, idx, device, world, rank)
    targets = torch.as_tensor(np.asarray(ds.targets)[idx], device=device)
    return (probs.argmax(1) == targets).float().mean().item()


def train_round(cfg, model, ds, labelled, device, world):
    sub = Subset(ds, labelled.tolist())
    sampler = DistributedSampler(sub, shuffle=True, drop_last=True)
    loader = DataLoader(sub, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True)
    lr = cfg.lr * world / 8
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    for ep in range(cfg.epochs):
        sampler.set_epoch(ep)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation / dropout streams per rank
    seed_everything(cfg.seed + rank)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    train_ds = torchvision.datasets.CIFAR100(cfg.data_root, train=True, transform=train_tf)
    plain_ds = torchvision.datasets.CIFAR100(cfg.data_root, train=True, transform=test_tf)
    test_ds = torchvision.datasets.CIFAR100(cfg.data_root, train=False, transform=test_tf)

    perm = np.random.permutation(len(train_ds))
    val_idx = np.sort(perm[: cfg.val_size])
    labelled = np.sort(perm[cfg.val_size: cfg.val_size + cfg.init_size])
    unlabelled = np.sort(perm[cfg.val_size + cfg.init_size:])
    test_idx = np.arange(len(test_ds))

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=2)

    curve = []
    for rnd in range(cfg.rounds):
        t0 = time.time()
        model = DDP(resnet34_cifar().to(device), device_ids=[local_rank])
        train_round(cfg, model, train_ds, labelled, device, world)
        val_acc = accuracy(model.module, plain_ds, val_idx, device, world, rank)
        test_acc = accuracy(model.module, test_ds, test_idx, device, world, rank)

        probs = predict_probs(model.module, plain_ds, unlabelled, device, world, rank)
        top2 = probs.topk(2, dim=1).values
        margin = (top2[:, 0] - top2[:, 1]).cpu().numpy()
        q = unlabelled[np.argsort(margin, kind="stable")[: cfg.query_size]]
        labelled = np.sort(np.concatenate([labelled, q]))
        unlabelled = np.setdiff1d(unlabelled, q)

        curve.append({"round": rnd, "n_labelled": int(len(labelled) - len(q)),
                      "val_acc": val_acc, "test_acc": test_acc, "sec": round(time.time() - t0)})
        if rank == 0:
            print(json.dumps(curve[-1]), flush=True)
            with open(os.path.join(cfg.out_dir, "curve.json"), "w") as f:
                json.dump(curve, f, indent=2)
            torch.save({"model": model.module.state_dict(), "labelled": torch.from_numpy(labelled),
                        "round": rnd}, os.path.join(cfg.out_dir, f"round{rnd}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
