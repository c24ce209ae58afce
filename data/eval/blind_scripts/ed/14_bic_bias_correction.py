"""BiC - Large Scale Incremental Learning (Wu et al., CVPR 2019), CIFAR-100.

Stage 1: CE + KD on new data and exemplars (DDP).
Stage 2: a two-parameter bias layer for the newest classes, fitted on a small
balanced validation set held out from exemplars and new data (cheap, so every
rank fits the same layer on the same data with the same seed).

Each task starts from the checkpoint of the previous one so that a job can be
restarted at any task with --start_task.

    torchrun --nproc_per_node=4 14_bic_bias_correction.py --out ./bic_c100 --start_task 0
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


def resnet32(num_classes):
    def block(i, o, s):
        return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                             nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o))

    class Res(nn.Module):
        def __init__(self, i, o, s):
            super().__init__()
            self.body = block(i, o, s)
            self.skip = nn.Identity() if (i == o and s == 1) else nn.Sequential(
                nn.Conv2d(i, o, 1, s, bias=False), nn.BatchNorm2d(o))

        def forward(self, x):
            return F.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    for i, o, s in [(16, 16, 1), (16, 32, 2), (32, 64, 2)]:
        layers += [Res(i, o, s)] + [Res(o, o, 1) for _ in range(4)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


class BiasLayers(nn.Module):
    def __init__(self, bounds):
        super().__init__()
        self.bounds = bounds
        self.alpha = nn.Parameter(torch.ones(len(bounds) - 1))
        self.beta = nn.Parameter(torch.zeros(len(bounds) - 1))

    def forward(self, logits, n_tasks):
        outs = []
        for k in range(n_tasks):
            lo, hi = self.bounds[k], self.bounds[k + 1]
            outs.append(self.alpha[k] * logits[:, lo:hi] + self.beta[k])
        return torch.cat(outs, dim=1)


@torch.no_grad()
def accuracy_matrix_row(net, bias, loader, bounds, t, device):
    net.eval()
    hit = np.zeros(t + 1)
    cnt = np.zeros(t + 1)
    for x, y in loader:
        pred = bias(net(x.to(device)), t + 1).argmax(1).cpu().numpy()
        y = y.numpy()
        task_of = np.searchsorted(bounds, y, side="right") - 1
        for k in range(t + 1):
            hit[k] += ((pred == y) & (task_of == k)).sum()
            cnt[k] += (task_of == k).sum()
    return 100.0 * hit / np.maximum(cnt, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./bic_c100")
    ap.add_argument("--n_tasks", type=int, default=5)
    ap.add_argument("--start_task", type=int, default=0)
    ap.add_argument("--memory", type=int, default=2000)
    ap.add_argument("--val_ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--bias_epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch_size", type=int, default=128, help="global")
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    plain_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose([transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR100(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    remap = np.argsort(np.random.RandomState(args.seed).permutation(100))
    for ds in (train_set, plain_set, test_set):
        ds.targets = remap[np.asarray(ds.targets)].tolist()
    y_tr, y_te = np.asarray(train_set.targets), np.asarray(test_set.targets)
    cpt = 100 // args.n_tasks
    bounds = [k * cpt for k in range(args.n_tasks + 1)]

    net = resnet32(100).to(device)
    bias = BiasLayers(bounds).to(device)
    old_net, old_bias = None, None
    memory = {}
    acc = np.zeros((args.n_tasks, args.n_tasks))

    for t in range(args.start_task, args.n_tasks):
        lo, hi = bounds[t], bounds[t + 1]
        if t > 0:
            ckpt = torch.load(os.path.join(args.out, f"bic_task{t - 1}.pth"), weights_only=False)
            net.load_state_dict(ckpt["net"])
            bias.load_state_dict(ckpt["bias"])
            memory, acc = ckpt["memory"], ckpt["acc"]
            old_net, old_bias = resnet32(100).to(device), BiasLayers(bounds).to(device)
            old_net.load_state_dict(ckpt["net"])
            old_bias.load_state_dict(ckpt["bias"])
            old_net.eval().requires_grad_(False)
            old_bias.requires_grad_(False)

        # split: BiC keeps val_ratio of every class (old: from exemplars, new: from task data) for stage 2
        rng = np.random.RandomState(args.seed + t)
        m = args.memory // hi
        n_val = max(1, int(m * args.val_ratio))
        new_train, val_idx = [], []
        for c in range(lo, hi):
            idx = rng.permutation(np.where(y_tr == c)[0]).tolist()
            val_idx += idx[:n_val]
            new_train += idx[n_val:]
        old_train = []
        for c in sorted(memory):
            val_idx += memory[c][:n_val]
            old_train += memory[c][n_val:]

        model = DDP(net, device_ids=[local_rank])
        data = Subset(train_set, new_train + old_train)
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [100, 150, 200], 0.1)
        lamb = lo / hi
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, :hi]
                loss = F.cross_entropy(logits, y)
                if old_net is not None:
                    with torch.no_grad():
                        old_logits = old_bias(old_net(x), t)
                    kd = F.kl_div(F.log_softmax(logits[:, :lo] / args.T, 1), F.softmax(old_logits / args.T, 1),
                                  reduction="batchmean") * args.T ** 2
                    loss = lamb * kd + (1 - lamb) * loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and epoch % 25 == 0:
                print(f"task {t} stage1 epoch {epoch} loss {loss.item():.4f}", flush=True)

        # stage 2: bias correction for the newest task on the balanced validation set
        if t > 0:
            net.eval()
            g = torch.Generator().manual_seed(args.seed + t)
            val_loader = DataLoader(Subset(plain_set, val_idx), batch_size=128, shuffle=True, generator=g,
                                    num_workers=2)
            bias_opt = torch.optim.SGD([bias.alpha, bias.beta], lr=0.001, momentum=0.9)
            for _ in range(args.bias_epochs):
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    with torch.no_grad():
                        raw = net(x)
                    loss = F.cross_entropy(bias(raw, t + 1), y)
                    bias_opt.zero_grad()
                    loss.backward()
                    bias.alpha.grad[:t] = 0
                    bias.beta.grad[:t] = 0
                    bias_opt.step()
            if rank == 0:
                print(f"task {t} bias alpha={bias.alpha[t].item():.3f} beta={bias.beta[t].item():.3f}")

        # random exemplars (same seeded RNG on every rank), shrink old ones
        memory = {c: v[:m] for c, v in memory.items()}
        for c in range(lo, hi):
            memory[c] = rng.choice(np.where(y_tr == c)[0], m, replace=False).tolist()

        if rank == 0:
            tl = DataLoader(Subset(test_set, np.where(y_te < hi)[0].tolist()), batch_size=256, num_workers=4)
            acc[t, :t + 1] = accuracy_matrix_row(net, bias, tl, bounds, t, device)
            print(f"== task {t}: {np.round(acc[t, :t + 1], 1).tolist()} avg {acc[t, :t + 1].mean():.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"net": net.state_dict(), "bias": bias.state_dict(), "memory": memory, "acc": acc},
                       os.path.join(args.out, f"bic_task{t}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
