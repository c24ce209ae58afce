"""Active learning on Food-101 with a pretrained ConvNeXt-T (timm) and ratio-of-confidence sampling.

score(x) = p_2nd(x) / p_1st(x); the closer to 1, the more ambiguous.

    torchrun --standalone --nproc_per_node=8 20_food101_convnext_al.py \
        --train_dir /data/food-101/train --test_dir /data/food-101/test
"""
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--test_dir", required=True)
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--out", default="./runs/food101_roc")
    ap.add_argument("--init_size", type=int, default=2020)
    ap.add_argument("--budget", type=int, default=2020)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch_per_gpu", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-4, help="AdamW lr at a global batch of 384")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--seed", type=int, default=21)
    return ap.parse_args()


def build_model(arch):
    return timm.create_model(arch, pretrained=True, num_classes=101, drop_path_rate=0.1)


def train_round(model, loader, args, device, world):
    lr = args.lr * args.batch_per_gpu * world / 384
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(loader)
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))
    model.train()
    for epoch in range(args.epochs):
        seen = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            seen += torch.stack([loss.detach().float() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(seen)
        if dist.get_rank() == 0:
            print(f"    epoch {epoch + 1}/{args.epochs}  loss {(seen[0] / seen[1]).item():.4f}", flush=True)


@torch.no_grad()
def infer(net, dataset, indices, device, args):
    """Gathered softmax outputs and the positions (into `indices`) they belong to."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sub = Subset(dataset, indices)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=128, sampler=sampler, num_workers=args.workers, pin_memory=True)
    net.eval()
    probs, labels = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x.to(device, non_blocking=True))
        probs.append(logits.float().softmax(-1))
        labels.append(y.to(device))
    probs, labels = torch.cat(probs), torch.cat(labels)
    pos = torch.tensor(list(sampler), device=device)
    res = []
    for t in (probs, labels, pos):
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        res.append(torch.cat(buf))
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        build_model(args.arch)  # populate the HF hub cache once
    dist.barrier()

    probe = build_model(args.arch)
    cfg = resolve_data_config({}, model=probe)
    del probe
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**cfg, is_training=False)
    train_view = datasets.ImageFolder(args.train_dir, transform=train_tf)
    eval_view = datasets.ImageFolder(args.train_dir, transform=eval_tf)
    test_set = datasets.ImageFolder(args.test_dir, transform=eval_tf)
    test_idx = list(range(len(test_set)))

    rng = np.random.default_rng(args.seed)
    labelled = rng.choice(len(train_view), args.init_size, replace=False).tolist()
    log = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        model = DDP(build_model(args.arch).to(device), device_ids=[local_rank])
        sub = Subset(train_view, labelled)
        sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
        train_round(model, loader, args, device, world)

        probs, labels, pos = infer(model.module, test_set, test_idx, device, args)
        hit = torch.zeros(len(test_idx), device=device)
        hit[pos] = (probs.argmax(-1) == labels).float()
        acc = hit.mean().item()
        if rank == 0:
            log.append({"round": rnd, "n_labelled": len(labelled), "top1": acc, "min": round((time.time() - t0) / 60, 1)})
            print(log[-1], flush=True)
            with open(os.path.join(args.out, "log.json"), "w") as f:
                json.dump(log, f, indent=2)
            torch.save({"model": model.module.state_dict(), "labelled": labelled},
                       os.path.join(args.out, f"round_{rnd}.pth"))
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = [i for i in range(len(train_view)) if i not in lab]
        probs, _, pos = infer(model.module, eval_view, pool, device, args)
        top2 = probs.topk(2, dim=-1).values
        roc = torch.full((len(pool),), -1.0, device=device)
        roc[pos] = top2[:, 1] / top2[:, 0]
        pick = torch.topk(roc, args.budget).indices.tolist()
        labelled = labelled + [pool[j] for j in pick]
        del model

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
