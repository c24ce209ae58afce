"""Deep ensemble on CIFAR-10, one ensemble member per GPU.

Every rank trains an independent ResNet-18 from its own random init
(Lakshminarayanan et al., 2017). There is no gradient sync between members;
the process group is only used to gather predictions for ensemble evaluation.

    torchrun --nproc_per_node=5 01_deep_ensemble_cifar.py --data-dir /data/cifar10
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
import torchvision
import torchvision.transforms as T


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--out-dir", default="./runs/deep_ensemble")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--val-size", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--n-bins", type=int, default=15)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def cifar_resnet18(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def build_datasets(args, rank):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])

    if rank == 0:
        torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
    dist.barrier()

    train_full = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    val_full = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=test_tf)
    test_set = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)

    perm = torch.randperm(len(train_full)).tolist()
    val_idx, train_idx = perm[: args.val_size], perm[args.val_size:]
    return Subset(train_full, train_idx), Subset(val_full, val_idx), test_set


@torch.no_grad()
def predict_logits(model, loader, device):
    model.eval()
    out, labels = [], []
    for x, y in loader:
        out.append(model(x.to(device, non_blocking=True)).float())
        labels.append(y.to(device))
    return torch.cat(out), torch.cat(labels)


def gather_member_probs(probs):
    """Stack the softmax outputs of all members: [M, N, C]."""
    world = dist.get_world_size()
    buf = [torch.empty_like(probs) for _ in range(world)]
    dist.all_gather(buf, probs)
    return torch.stack(buf)


def ece_score(probs, labels, n_bins=15):
    conf, pred = probs.max(1)
    acc = pred.eq(labels).float()
    edges = torch.linspace(0, 1, n_bins + 1, device=probs.device)
    ece = torch.zeros((), device=probs.device)
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            ece += m.float().mean() * (conf[m].mean() - acc[m].mean()).abs()
    return ece.item()


def fit_temperature(logits, labels, iters=100):
    log_t = torch.zeros(1, device=logits.device, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.05, max_iter=iters)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    opt.step(closure)
    return log_t.exp().item()


def train_one_epoch(model, loader, opt, sched, device, scaler):
    model.train()
    total, correct, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        loss_sum += loss.item() * y.size(0)
        correct += logits.argmax(1).eq(y).sum().item()
        total += y.size(0)
    return loss_sum / total, correct / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()

    # different init / augmentation stream for every member
    seed_everything(args.seed + 1000 * rank)

    train_set, val_set, test_set = build_datasets(args, rank)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=512, shuffle=False, num_workers=args.workers)
    test_loader = DataLoader(test_set, batch_size=512, shuffle=False, num_workers=args.workers)

    model = cifar_resnet18().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.wd, nesterov=True)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps,
                                                pct_start=0.15, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # bf16 needs no scaling

    os.makedirs(args.out_dir, exist_ok=True)
    member_path = os.path.join(args.out_dir, f"member_{rank}.pt")

    for epoch in range(args.epochs):
        t0 = time.time()
        tr_loss, tr_acc = train_one_epoch(model, train_loader, opt, sched, device, scaler)
        if epoch % 10 == 0 or epoch == args.epochs - 1:
            print(f"[member {rank}] epoch {epoch:3d} loss {tr_loss:.4f} "
                  f"acc {tr_acc:.4f} ({time.time() - t0:.1f}s)", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "seed": args.seed + 1000 * rank},
                       member_path)

    torch.save({"model": model.state_dict(), "epoch": args.epochs, "seed": args.seed + 1000 * rank},
               member_path)

    # ---- ensemble evaluation ------------------------------------------------
    val_logits, val_labels = predict_logits(model, val_loader, device)
    test_logits, test_labels = predict_logits(model, test_loader, device)

    # per-member temperature, then average the calibrated probabilities
    temp = fit_temperature(val_logits, val_labels)
    member_val = gather_member_probs(F.softmax(val_logits / temp, dim=1))
    member_test = gather_member_probs(F.softmax(test_logits / temp, dim=1))
    member_test_raw = gather_member_probs(F.softmax(test_logits, dim=1))

    temps = torch.tensor([temp], device=device)
    all_temps = [torch.empty_like(temps) for _ in range(world)]
    dist.all_gather(all_temps, temps)

    if rank == 0:
        results = {"members": world, "temperatures": [t.item() for t in all_temps]}
        ens_val = member_val.mean(0)
        results["val_nll_ts"] = F.nll_loss(ens_val.clamp_min(1e-12).log(), val_labels).item()
        for name, p in (("raw", member_test_raw), ("ts", member_test)):
            ens = p.mean(0)
            results[f"test_acc_{name}"] = ens.argmax(1).eq(test_labels).float().mean().item()
            results[f"test_nll_{name}"] = F.nll_loss(ens.clamp_min(1e-12).log(), test_labels).item()
            results[f"test_ece_{name}"] = ece_score(ens, test_labels, args.n_bins)
            results[f"member_acc_{name}"] = [
                p[m].argmax(1).eq(test_labels).float().mean().item() for m in range(world)
            ]
        # predictive diversity: mean pairwise disagreement
        preds = member_test_raw.argmax(2)
        dis = [preds[i].ne(preds[j]).float().mean().item()
               for i in range(world) for j in range(i + 1, world)]
        results["disagreement"] = float(np.mean(dis)) if dis else 0.0
        results["entropy"] = (-(member_test_raw.mean(0) * member_test_raw.mean(0).clamp_min(1e-12).log())
                              .sum(1).mean().item())
        print(json.dumps(results, indent=2))
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
