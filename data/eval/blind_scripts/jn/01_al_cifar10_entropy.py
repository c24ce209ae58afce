"""Pool-based active learning on CIFAR-10 with max-entropy acquisition.

Every round the ResNet-18 is re-initialised and trained on the current
labelled set, the unlabelled pool is scored on all ranks and the top-k most
uncertain images are moved to the labelled set.

    torchrun --standalone --nproc_per_node=8 01_al_cifar10_entropy.py \
        --data /datasets/cifar10 --out /shared/al/c10_entropy
"""
import argparse
import json
import logging
import os
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

log = logging.getLogger("al")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser(description="CIFAR-10 entropy active learning")
    p.add_argument("--data", default="/datasets/cifar10")
    p.add_argument("--out", required=True)
    p.add_argument("--init-size", type=int, default=1000)
    p.add_argument("--query-size", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr at global batch 256")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def setup_dist():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_model():
    net = torchvision.models.resnet18(num_classes=10)
    # CIFAR stem: 3x3 conv, no max-pool
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def make_datasets(root):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf)
    pool = torchvision.datasets.CIFAR10(root, train=True, transform=test_tf)
    test = torchvision.datasets.CIFAR10(root, train=False, transform=test_tf)
    return train, pool, test


def train_one_round(model, train_set, labelled, args, world_size, device, rnd):
    per_gpu = args.batch_size // world_size
    subset = Subset(train_set, labelled.tolist())
    sampler = DistributedSampler(subset, shuffle=True, seed=args.seed + rnd, drop_last=True)
    loader = DataLoader(subset, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    lr = args.base_lr * args.batch_size / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                          weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, total_steps=args.epochs * len(loader), pct_start=0.15)

    model.train()
    running = torch.zeros(2, device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if epoch == args.epochs - 1:
                running += torch.stack([loss.detach() * y.numel(),
                                        torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(running)
    return (running[0] / running[1].clamp_min(1)).item()


@torch.no_grad()
def evaluate(net, test_set, rank, world_size, device):
    # contiguous, non-overlapping shards, so nothing is counted twice
    shard = np.array_split(np.arange(len(test_set)), world_size)[rank]
    loader = DataLoader(Subset(test_set, shard.tolist()), batch_size=500, num_workers=4)
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device, non_blocking=True)
        pred = net(x.to(device, non_blocking=True)).argmax(1)
        stats[0] += (pred == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def score_pool(net, pool_set, unlabelled, args, device, rank, world_size):
    """Entropy of every unlabelled image; every rank gets the full result."""
    shard = np.array_split(unlabelled, world_size)[rank]
    loader = DataLoader(Subset(pool_set, shard.tolist()), batch_size=1000,
                        num_workers=args.workers, pin_memory=True)
    net.eval()
    ents = []
    for x, _ in loader:
        p = F.softmax(net(x.to(device, non_blocking=True)).float(), dim=1)
        ents.append(-(p * torch.log(p.clamp_min(1e-12))).sum(1))
    ent = torch.cat(ents) if ents else torch.empty(0, device=device)
    idx = torch.as_tensor(shard, dtype=torch.long, device=device)

    # shards differ by at most one element; pad to the largest for all_gather
    n = torch.tensor([ent.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    ent_pad = torch.full((max_n,), -1.0, device=device)
    ent_pad[: ent.numel()] = ent
    idx_pad = torch.full((max_n,), -1, dtype=torch.long, device=device)
    idx_pad[: idx.numel()] = idx
    ent_all = [torch.empty_like(ent_pad) for _ in range(world_size)]
    idx_all = [torch.empty_like(idx_pad) for _ in range(world_size)]
    dist.all_gather(ent_all, ent_pad)
    dist.all_gather(idx_all, idx_pad)
    ent_all = torch.cat([e[:s] for e, s in zip(ent_all, sizes)])
    idx_all = torch.cat([i[:s] for i, s in zip(idx_all, sizes)])
    return ent_all, idx_all


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_dist()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}] %(message)s")
    if args.batch_size % world_size:
        raise ValueError(f"batch size {args.batch_size} not divisible by world size {world_size}")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    train_set, pool_set, test_set = make_datasets(args.data)
    n_total = len(train_set)

    # same seed on every rank -> identical initial labelled set
    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(n_total, size=args.init_size, replace=False))
    start_round = 0
    state_path = os.path.join(args.out, "al_state.pt")
    if os.path.exists(state_path):
        state = torch.load(state_path, map_location="cpu")
        labelled = state["labelled"].numpy()
        start_round = state["round"] + 1
        log.info("resuming at round %d with %d labelled images", start_round, len(labelled))

    for rnd in range(start_round, args.rounds):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
        model = DDP(model, device_ids=[local_rank], output_device=local_rank)

        train_loss = train_one_round(model, train_set, labelled, args, world_size, device, rnd)
        acc = evaluate(model.module, test_set, rank, world_size, device)
        log.info("round %d | labelled %d | loss %.4f | test acc %.4f | %.0fs",
                 rnd, len(labelled), train_loss, acc, time.time() - t0)

        unlabelled = np.setdiff1d(np.arange(n_total), labelled)
        ent, idx = score_pool(model.module, pool_set, unlabelled, args, device, rank, world_size)
        k = min(args.query_size, idx.numel())
        chosen = idx[torch.topk(ent, k).indices].contiguous()
        dist.broadcast(chosen, src=0)
        labelled = np.union1d(labelled, chosen.cpu().numpy())

        if rank == 0:
            tmp = state_path + ".tmp"
            torch.save({
                "round": rnd,
                "labelled": torch.from_numpy(labelled),
                "model": model.module.state_dict(),
                "test_acc": acc,
            }, tmp)
            os.replace(tmp, state_path)
            with open(os.path.join(args.out, "curve.jsonl"), "a") as f:
                f.write(json.dumps({"round": rnd, "n_labelled": int(len(labelled) - k),
                                    "test_acc": acc, "train_loss": train_loss}) + "\n")
        dist.barrier()
        del model
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
