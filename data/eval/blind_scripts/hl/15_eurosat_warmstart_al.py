#!/usr/bin/env python
"""Active learning for land-cover classification (EuroSAT RGB, 10 classes).

Rounds are warm-started: the network of round r starts from the weights of round r-1
and is fine-tuned for a few epochs on the grown labelled set (much cheaper than
training from scratch every round). Query strategy: BvSB margin.

    torchrun --standalone --nproc_per_node=4 15_eurosat_warmstart_al.py \
        --data /data/EuroSAT_RGB --work_dir ./work/eurosat_al
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work_dir", required=True)
    p.add_argument("--test_frac", type=float, default=0.2)
    p.add_argument("--init_size", type=int, default=500)
    p.add_argument("--budget", type=int, default=500)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--first_epochs", type=int, default=30)
    p.add_argument("--ft_epochs", type=int, default=8)
    p.add_argument("--batch_per_gpu", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=99)
    return p.parse_args()


def build_model(pretrained=True):
    net = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2 if pretrained else None)
    net.fc = nn.Linear(net.fc.in_features, 10)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


def train_epochs(model, loader, sampler, epochs, lr, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
    model.train()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()


@torch.no_grad()
def run_inference(net, dataset, indices, device, rank, world, bs=256):
    sub = Subset(dataset, indices)
    sampler = DistributedSampler(sub, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(sub, batch_size=bs, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    probs, ys = [], []
    for x, y in loader:
        probs.append(F.softmax(net(x.to(device, non_blocking=True)), 1))
        ys.append(y.to(device))
    probs, ys = torch.cat(probs), torch.cat(ys)
    pos = torch.tensor(list(sampler), device=device)
    out = []
    for t in (probs, ys, pos):
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        out.append(torch.cat(buf))
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
    dist.barrier()

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(64, scale=(0.6, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                                   transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_view = datasets.ImageFolder(args.data, transform=train_tf)
    eval_view = datasets.ImageFolder(args.data, transform=eval_tf)

    perm = np.random.RandomState(args.seed).permutation(len(train_view))
    n_test = int(args.test_frac * len(perm))
    test_idx = perm[:n_test].tolist()
    labelled = perm[n_test:n_test + args.init_size].tolist()
    pool = perm[n_test + args.init_size:].tolist()

    history = []
    prev_ckpt = None
    for rnd in range(args.rounds + 1):
        t0 = time.time()
        if prev_ckpt is None:
            net = build_model(pretrained=True)
            epochs = args.first_epochs
        else:
            net = build_model(pretrained=False)
            net.load_state_dict(torch.load(prev_ckpt, map_location="cpu")["model"])
            epochs = args.ft_epochs
        model = DDP(net.to(device), device_ids=[local_rank])

        sub = Subset(train_view, labelled)
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(sub, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        lr = args.lr * (args.batch_per_gpu * world) / 128
        train_epochs(model, loader, sampler, epochs, lr, device)

        probs, ys, pos = run_inference(model.module, eval_view, test_idx, device, rank, world)
        correct = torch.zeros(len(test_idx), device=device)
        correct[pos] = (probs.argmax(1) == ys).float()  # repeated (padded) samples land on the same slot
        acc = correct.mean().item()

        ckpt_path = os.path.join(args.work_dir, f"round_{rnd:02d}.pt")
        if rank == 0:
            torch.save({"model": model.state_dict(), "round": rnd, "labelled": labelled}, ckpt_path)
            history.append({"round": rnd, "n_labelled": len(labelled), "acc": acc, "epochs": epochs,
                            "minutes": round((time.time() - t0) / 60, 2)})
            print(history[-1], flush=True)
            with open(os.path.join(args.work_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
        dist.barrier()
        prev_ckpt = ckpt_path
        if rnd == args.rounds:
            break

        probs, _, pos = run_inference(model.module, eval_view, pool, device, rank, world)
        top2 = probs.topk(2, dim=1).values
        margin = torch.full((len(pool),), float("inf"), device=device)
        margin[pos] = top2[:, 0] - top2[:, 1]
        pick = torch.topk(-margin, args.budget).indices.tolist()
        picked = set(pick)
        labelled += [pool[j] for j in pick]
        pool = [q for j, q in enumerate(pool) if j not in picked]
        del model, net

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
