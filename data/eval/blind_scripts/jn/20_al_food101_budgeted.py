"""Budgeted active learning on Food-101 (ConvNeXt-T, margin sampling).

The annotation team works in fixed cycles, so each round's training is capped by
a wall-clock budget as well as by the number of epochs.

    torchrun --standalone --nproc_per_node=8 20_al_food101_budgeted.py --root /datasets --out /shared/al/food101
"""
import argparse
import json
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from timm.data import Mixup
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets")
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--init", type=int, default=5050)
    ap.add_argument("--query", type=int, default=5050)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--round-minutes", type=float, default=45.0, help="training time budget per round")
    ap.add_argument("--batch-size", type=int, default=512, help="global batch")
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 512")
    ap.add_argument("--mixup", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


@torch.no_grad()
def margin_scores(net, ds, idx, device):
    sub = Subset(ds, idx.tolist())
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=512, sampler=sampler, num_workers=10, pin_memory=True)
    net.eval()
    out = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = net(x.to(device, non_blocking=True)).float().softmax(1)
        top2 = p.topk(2, dim=1).values
        out.append(top2[:, 0] - top2[:, 1])
    local = torch.cat(out)
    # which positions of `idx` this rank scored (DistributedSampler, shuffle=False, padded)
    pos = torch.as_tensor(list(iter(sampler)), device=device)
    world = dist.get_world_size()
    M = [torch.empty_like(local) for _ in range(world)]
    P = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(M, local)
    dist.all_gather(P, pos)
    margins = torch.full((len(idx),), float("inf"), device=device)
    margins[torch.cat(P)] = torch.cat(M)
    return margins.cpu().numpy()


@torch.no_grad()
def top1(net, ds, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=512, num_workers=10)
    net.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        y = y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            acc[0] += (net(x.to(device, non_blocking=True)).argmax(1) == y).sum()
        acc[1] += len(y)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf_train = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.TrivialAugmentWide(), transforms.ToTensor(), norm])
    tf_eval = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_ds = torchvision.datasets.Food101(args.root, split="train", transform=tf_train)
    pool_ds = torchvision.datasets.Food101(args.root, split="train", transform=tf_eval)
    test_ds = torchvision.datasets.Food101(args.root, split="test", transform=tf_eval)

    labelled = np.sort(np.random.default_rng(args.seed).choice(len(train_ds), args.init, replace=False))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=101)
    per_gpu = args.batch_size // world
    budget_s = args.round_minutes * 60

    for rnd in range(args.rounds):
        torch.manual_seed(args.seed + rnd)
        model = timm.create_model(args.arch, pretrained=True, num_classes=101, drop_path_rate=0.1)
        model = DDP(model.to(device), device_ids=[local_rank])
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=per_gpu, sampler=sampler, num_workers=10,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * args.batch_size / 512, weight_decay=0.05)
        total = args.epochs * len(loader)
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

        t0 = time.time()
        steps, out_of_time = 0, False
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                x, y_soft = mixup(x, y)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = torch.sum(-y_soft * F.log_softmax(model(x).float(), dim=-1), dim=-1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                steps += 1
                if time.time() - t0 > budget_s:
                    out_of_time = True
                    break
            if out_of_time:
                break
        train_min = (time.time() - t0) / 60

        acc = top1(model.module, test_ds, device)
        unlabelled = np.setdiff1d(np.arange(len(train_ds)), labelled)
        m = margin_scores(model.module, pool_ds, unlabelled, device)
        query = unlabelled[np.argsort(m, kind="stable")[: args.query]]
        labelled = np.union1d(labelled, query)

        if rank == 0:
            rec = {"round": rnd, "n_labelled": len(sub), "test_top1": acc, "steps": steps,
                   "epochs_done": epoch + 1, "train_minutes": round(train_min, 1), "hit_budget": out_of_time}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "rounds.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.module.state_dict(), "labelled": labelled.tolist(), "round": rnd},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
