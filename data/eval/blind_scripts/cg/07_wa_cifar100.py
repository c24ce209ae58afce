"""Weight Aligning (Zhao et al., CVPR 2020) for class-incremental CIFAR-100.

KD from the previous model + exemplar replay; after each task the new-class classifier
weights are rescaled so their norms match the old ones.

  torchrun --nproc_per_node=4 07_wa_cifar100.py --increments 20 --memory 2000 --out results/wa_c100_5s
"""
import argparse
import copy
import csv
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from timm.models.resnet import resnet18d


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="results/wa")
    p.add_argument("--increments", type=int, default=20)
    p.add_argument("--memory", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = resnet18d(pretrained=False, num_classes=0)
        self.fc = nn.Linear(self.features.num_features, 0, bias=False)

    def add_classes(self, n):
        old = self.fc.weight.data
        self.fc = nn.Linear(old.size(1), old.size(0) + n, bias=False).to(old.device)
        self.fc.weight.data[: old.size(0)] = old

    def forward(self, x):
        return self.fc(self.features(x))

    @torch.no_grad()
    def align_weights(self, n_old):
        w = self.fc.weight.data
        gamma = w[:n_old].norm(dim=1).mean() / w[n_old:].norm(dim=1).mean()
        w[n_old:] *= gamma
        return gamma.item()


@torch.no_grad()
def evaluate(net, test_set, targets, lo, hi, device):
    net.eval()
    sub = Subset(test_set, np.flatnonzero((targets >= lo) & (targets < hi)))
    loader = DataLoader(sub, batch_size=100, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=2)
    correct = total = 0
    for x, y in loader:
        pred = net(x.to(device)).argmax(1).cpu()
        correct += (pred == y).sum().item()
        total += y.size(0)
    net.train()
    return 100.0 * correct / total


def main():
    args = args_()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    order = np.random.RandomState(args.seed).permutation(100)
    rank_of = np.empty(100, dtype=np.int64)
    rank_of[order] = np.arange(100)
    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    aug = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                              transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm])
    if rank == 0:
        datasets.CIFAR100(args.data, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    remap = lambda y: int(rank_of[y])
    train_set = datasets.CIFAR100(args.data, True, aug, target_transform=remap)
    test_set = datasets.CIFAR100(args.data, False, transforms.Compose([transforms.ToTensor(), norm]),
                                 target_transform=remap)
    y_train = rank_of[np.array(train_set.targets)]
    y_test = rank_of[np.array(test_set.targets)]

    n_tasks = 100 // args.increments
    net = Net().to(device)
    old_net = None
    exemplars, memory = [], {}
    acc = np.full((n_tasks, n_tasks), np.nan)
    rng = np.random.RandomState(args.seed)

    for t in range(n_tasks):
        lo, hi = t * args.increments, (t + 1) * args.increments
        net.add_classes(args.increments)
        model = DDP(net, device_ids=[local_rank])
        idx = np.concatenate([np.flatnonzero((y_train >= lo) & (y_train < hi)),
                              np.asarray(exemplars, dtype=np.int64)])
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [60, 120], 0.1)
        lam = lo / hi

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        t_logits = old_net(x)
                    kd = F.kl_div(F.log_softmax(logits[:, :lo] / args.T, 1),
                                  F.softmax(t_logits / args.T, 1), reduction="batchmean") * args.T ** 2
                    loss = (1 - lam) * loss + lam * kd
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and (ep + 1) % 20 == 0:
                print(f"task {t} epoch {ep + 1}/{args.epochs} loss {loss.item():.4f}", flush=True)

        if t > 0:
            g = net.align_weights(lo)
            if rank == 0:
                print(f"weight aligning gamma = {g:.4f}")

        # random exemplars, same on every rank (shared rng)
        per_class = args.memory // hi
        for c in range(lo):
            memory[c] = memory[c][:per_class]
        for c in range(lo, hi):
            pool = np.flatnonzero(y_train == c)
            memory[c] = rng.choice(pool, per_class, replace=False).tolist()
        exemplars = [i for c in range(hi) for i in memory[c]]

        for j in range(t + 1):
            acc[t, j] = evaluate(net, test_set, y_test, j * args.increments, (j + 1) * args.increments,
                                 device)
        if rank == 0:
            avg = np.nanmean(acc[t, : t + 1])
            fgt = np.mean([np.nanmax(acc[:t, j]) - acc[t, j] for j in range(t)]) if t else 0.0
            print(f"[task {t}] avg inc acc {avg:.2f}  forgetting {fgt:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "acc_matrix.csv"), "w", newline="") as f:
                csv.writer(f).writerows(np.round(acc, 2).tolist())
            torch.save({"net": net.state_dict(), "task": t, "exemplars": exemplars},
                       os.path.join(args.out, f"wa_task{t}.pt"))
        dist.barrier()
        old_net = copy.deepcopy(net).eval().requires_grad_(False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
