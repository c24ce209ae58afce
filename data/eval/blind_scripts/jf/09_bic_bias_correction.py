"""BiC - Large Scale Incremental Learning (Wu et al., CVPR 2019), CIFAR-100 in 5 steps.

Stage 1: train on new data + exemplars with CE and distillation from the model
of the previous step (loaded from that step's checkpoint).
Stage 2: fit the two-parameter bias correction layer on a small held-out
balanced validation set.

    torchrun --nproc_per_node=4 09_bic_bias_correction.py --exp-dir /nfs/exp/bic_c100
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/nfs/datasets/cifar100")
    p.add_argument("--exp-dir", default="/nfs/exp/bic_c100")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--memory", type=int, default=2000)
    p.add_argument("--val-ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--bias-epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128, help="global")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class BiasLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.beta = nn.Parameter(torch.zeros(1))

    def forward(self, logits, n_old):
        new = logits[:, n_old:] * self.alpha + self.beta
        return torch.cat([logits[:, :n_old], new], dim=1)


def make_model():
    m = resnet18(num_classes=100)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def ckpt_path(exp_dir, step):
    return os.path.join(exp_dir, f"step_{step}.pth")


def split_train_val(targets, classes, n_val_per_class, rng):
    tr, va = [], []
    for c in classes:
        idx = rng.permutation(np.where(targets == c)[0])
        va += idx[:n_val_per_class].tolist()
        tr += idx[n_val_per_class:].tolist()
    return tr, va


@torch.no_grad()
def evaluate(net, bias, test_set, y_test, n_known, n_old, device, rank, world):
    net.eval()
    idx = np.where(y_test < n_known)[0][rank::world]
    hit = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, idx), batch_size=256, num_workers=4):
        x, y = x.to(device), y.to(device)
        out = net(x)[:, :n_known]
        if bias is not None and n_old > 0:
            out = bias(out, n_old)
        hit[0] += (out.argmax(1) == y).sum()
        hit[1] += y.numel()
    dist.all_reduce(hit)
    return (100 * hit[0] / hit[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.exp_dir, exist_ok=True)

    norm = transforms.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    plain = transforms.Compose([transforms.ToTensor(), norm])
    test_set = datasets.CIFAR100(args.data, train=False, transform=plain)
    train_plain = datasets.CIFAR100(args.data, train=True, transform=plain)
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)

    inc = 100 // args.steps
    mem_train, mem_val = [], []
    local_bs = args.batch_size // world
    log = []

    for step in range(args.steps):
        n_old, n_known = step * inc, (step + 1) * inc
        new_classes = list(range(n_old, n_known))
        rng = np.random.RandomState(args.seed + step)
        per_class = args.memory // n_known
        n_val = max(int(per_class * args.val_ratio), 1)
        new_tr, new_va = split_train_val(y_train, new_classes, n_val, rng)

        net = make_model().to(device)
        teacher = None
        if step > 0:
            state = torch.load(ckpt_path(args.exp_dir, step - 1), map_location=device)
            net.load_state_dict(state["model"])
            teacher = make_model().to(device)
            teacher.load_state_dict(state["model"])
            teacher.eval().requires_grad_(False)
        model = DDP(net, device_ids=[local_rank])

        # ---------------- stage 1
        ds = Subset(train_set, new_tr + mem_train)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=local_bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [100, 150, 200], 0.1)
        lam = n_old / n_known
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            net.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, :n_known]
                loss = F.cross_entropy(logits, y)
                if teacher is not None:
                    with torch.no_grad():
                        old = teacher(x)[:, :n_old]
                    kd = F.kl_div(F.log_softmax(logits[:, :n_old] / args.T, 1),
                                  F.softmax(old / args.T, 1), reduction="batchmean") * args.T ** 2
                    loss = (1 - lam) * loss + lam * kd
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and ep % 25 == 0:
                print(f"[step {step}] stage1 ep {ep} loss {loss.item():.4f}", flush=True)

        # ---------------- stage 2: bias correction on the balanced val set
        bias = None
        if step > 0:
            bias = BiasLayer().to(device)
            bias_ddp = DDP(bias, device_ids=[local_rank])
            val_ds = Subset(train_plain, new_va + mem_val)
            vsampler = DistributedSampler(val_ds, shuffle=True, seed=args.seed)
            vloader = DataLoader(val_ds, batch_size=max(local_bs, 32), sampler=vsampler, num_workers=2)
            bopt = torch.optim.SGD(bias_ddp.parameters(), lr=0.001, momentum=0.9)
            net.eval()
            for ep in range(args.bias_epochs):
                vsampler.set_epoch(ep)
                for x, y in vloader:
                    x, y = x.to(device), y.to(device)
                    with torch.no_grad():
                        logits = net(x)[:, :n_known]
                    loss = F.cross_entropy(bias_ddp(logits, n_old), y)
                    bopt.zero_grad()
                    loss.backward()
                    bopt.step()
            if rank == 0:
                print(f"[step {step}] bias alpha={bias.alpha.item():.3f} beta={bias.beta.item():.3f}")

        acc = evaluate(net, bias, test_set, y_test, n_known, n_old, device, rank, world)
        log.append(acc)
        if rank == 0:
            print(f"==> step {step}: {n_known} classes, acc {acc:.2f}", flush=True)

        torch.save({"model": net.state_dict(),
                    "bias": bias.state_dict() if bias is not None else None,
                    "acc": log}, ckpt_path(args.exp_dir, step))

        # rebuild the exemplar memory with the new per-class budget (same rng on every rank)
        per_class = args.memory // n_known
        n_val = max(int(per_class * args.val_ratio), 1)
        mem_train, mem_val = [], []
        for c in range(n_known):
            idx = np.random.RandomState(args.seed * 1000 + c).permutation(np.where(y_train == c)[0])
            mem_val += idx[:n_val].tolist()
            mem_train += idx[n_val:per_class].tolist()

    if rank == 0:
        print("incremental accuracy:", [round(a, 2) for a in log], "avg", round(float(np.mean(log)), 2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
