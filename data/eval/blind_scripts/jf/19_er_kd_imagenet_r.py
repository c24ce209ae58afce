"""Split ImageNet-R (200 classes, 10 tasks of 20): replay + logit distillation
from the previous model, reporting class-IL and task-IL accuracy matrices.

ImageNet-R has no official split: 80% / 20% per class with a fixed seed.

    torchrun --nproc_per_node=8 19_er_kd_imagenet_r.py --root /data/imagenet-r \
        --backbone-ckpt /models/resnet50_in1k.pth
"""
import argparse
import copy
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/imagenet-r")
    p.add_argument("--backbone-ckpt", default="/models/resnet50_in1k.pth")
    p.add_argument("--out", default="/data/exp/er_kd_inr")
    p.add_argument("--n-tasks", type=int, default=10)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256, help="global")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mem-per-class", type=int, default=20)
    p.add_argument("--kd", type=float, default=1.0)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def split_imagenet_r(targets, seed, ratio=0.8):
    rng = np.random.RandomState(seed)
    tr, te = [], []
    for c in np.unique(targets):
        idx = rng.permutation(np.where(targets == c)[0])
        k = int(len(idx) * ratio)
        tr += idx[:k].tolist()
        te += idx[k:].tolist()
    return np.array(tr), np.array(te)


@torch.no_grad()
def eval_task(net, loader, task_classes, n_seen, device):
    """Returns (class-IL acc, task-IL acc) on one task's test data."""
    net.eval()
    til_mask = torch.full((200,), float("-inf"), device=device)
    til_mask[task_classes] = 0.0
    c_cil = c_til = total = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = net(x)
        c_cil += (logits[:, :n_seen].argmax(1) == y).sum().item()
        c_til += ((logits + til_mask).argmax(1) == y).sum().item()
        total += y.numel()
    net.train()
    return 100.0 * c_cil / total, 100.0 * c_til / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    full_aug = datasets.ImageFolder(args.root, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    full_plain = datasets.ImageFolder(args.root, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    targets = np.array(full_aug.targets)
    tr_idx, te_idx = split_imagenet_r(targets, args.seed)
    cpt = 200 // args.n_tasks
    # classes 0..199 in folder order; task t owns [t*cpt, (t+1)*cpt)

    net = models.resnet50()
    net.load_state_dict(torch.load(args.backbone_ckpt, map_location="cpu"))
    net.fc = nn.Linear(2048, 200)
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank])
    teacher = None
    memory = []
    acc_cil = np.zeros((args.n_tasks, args.n_tasks))
    acc_til = np.zeros((args.n_tasks, args.n_tasks))
    local_bs = args.batch_size // world

    test_loaders = []
    for t in range(args.n_tasks):
        idx = te_idx[(targets[te_idx] >= t * cpt) & (targets[te_idx] < (t + 1) * cpt)]
        ds = Subset(full_plain, idx.tolist())
        test_loaders.append(DataLoader(ds, batch_size=128, num_workers=4,
                                       sampler=DistributedSampler(ds, shuffle=False)))

    for t in range(args.n_tasks):
        lo, hi = t * cpt, (t + 1) * cpt
        cur = tr_idx[(targets[tr_idx] >= lo) & (targets[tr_idx] < hi)].tolist()
        ds = Subset(full_aug, cur + memory)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=local_bs, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))
        scaler = torch.cuda.amp.GradScaler()

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)[:, :hi]
                    loss = F.cross_entropy(logits, y)
                    if teacher is not None:
                        with torch.no_grad():
                            old = teacher(x)[:, :lo]
                        loss = loss + args.kd * F.kl_div(
                            F.log_softmax(logits[:, :lo].float() / args.T, 1),
                            F.softmax(old.float() / args.T, 1), reduction="batchmean") * args.T ** 2
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
            if rank == 0:
                print(f"task {t} ep {ep} loss {loss.item():.4f} ({time.time() - tic:.0f}s)", flush=True)

        for j in range(t + 1):
            task_classes = torch.arange(j * cpt, (j + 1) * cpt, device=device)
            acc_cil[t, j], acc_til[t, j] = eval_task(net, test_loaders[j], task_classes, hi, device)

        if rank == 0:
            print(f"== after task {t}: CIL avg {acc_cil[t, :t + 1].mean():.2f} | "
                  f"TIL avg {acc_til[t, :t + 1].mean():.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "task": t}, os.path.join(args.out, f"task{t}.pt"))

        # exemplars for the classes just learned (fixed seed -> same on all ranks)
        rng = np.random.RandomState(args.seed + t)
        for c in range(lo, hi):
            pool = tr_idx[targets[tr_idx] == c]
            memory += rng.choice(pool, min(args.mem_per_class, len(pool)), replace=False).tolist()
        teacher = copy.deepcopy(net).eval()
        teacher.requires_grad_(False)
        dist.barrier()

    if rank == 0:
        n = args.n_tasks
        fgt = lambda A: float(np.mean([A[j:n - 1, j].max() - A[n - 1, j] for j in range(n - 1)]))
        summary = {"cil_final": float(acc_cil[-1].mean()), "til_final": float(acc_til[-1].mean()),
                   "cil_forgetting": fgt(acc_cil), "til_forgetting": fgt(acc_til),
                   "acc_cil": acc_cil.tolist(), "acc_til": acc_til.tolist()}
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("acc_")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
