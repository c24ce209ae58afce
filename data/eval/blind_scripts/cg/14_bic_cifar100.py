"""BiC - Large Scale Incremental Learning (Wu et al., CVPR 2019), CIFAR-100, 5 x 20 classes.

Stage 1: CE + KD on new data + train exemplars. Stage 2: a 2-parameter bias layer on the new
class logits, fitted on a small balanced validation set held out from data and exemplars.

    torchrun --nproc_per_node=4 14_bic_cifar100.py --run-name bic_c100_5x20 --out runs/bic
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/bic")
    p.add_argument("--run-name", default=None)
    p.add_argument("--project", default="continual-bic")
    p.add_argument("--step", type=int, default=20)
    p.add_argument("--memory", type=int, default=2000)
    p.add_argument("--val-ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--bias-epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


class BiasLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.beta = nn.Parameter(torch.zeros(1))

    def forward(self, logits, lo):
        return torch.cat([logits[:, :lo], self.alpha * logits[:, lo:] + self.beta], dim=1)


class Backbone(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        net = resnet18(num_classes=n_classes)
        net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        self.net = net

    def forward(self, x):
        return self.net(x)


def split_train_val(indices, ratio, rng):
    indices = rng.permutation(indices)
    n_val = max(1, int(round(len(indices) * ratio)))
    return indices[n_val:].tolist(), indices[:n_val].tolist()


@torch.no_grad()
def evaluate(model, biases, bounds, test_set, y_test, t, device, rank, world):
    model.eval()
    res = []
    for j in range(t + 1):
        idx = np.flatnonzero((y_test >= bounds[j]) & (y_test < bounds[j + 1]))[rank::world]
        c = torch.zeros(2, device=device)
        for x, y in DataLoader(Subset(test_set, idx), batch_size=256, num_workers=2):
            x, y = x.to(device), y.to(device)
            out = model(x)[:, : bounds[t + 1]]
            for k, b in enumerate(biases, start=1):
                out = b(out, bounds[k])
            c[0] += (out.argmax(1) == y).sum()
            c[1] += len(y)
        dist.all_reduce(c)
        res.append((100 * c[0] / c[1]).item())
    return res


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2762))
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    order = np.random.RandomState(args.seed).permutation(100)
    lab = np.argsort(order)
    tt = lambda y: int(lab[y])
    train_set = datasets.CIFAR100(args.data, True, transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]),
        target_transform=tt)
    plain_train = datasets.CIFAR100(args.data, True, transforms.Compose([transforms.ToTensor(), norm]),
                                    target_transform=tt)
    test_set = datasets.CIFAR100(args.data, False, transforms.Compose([transforms.ToTensor(), norm]),
                                 target_transform=tt)
    y_train, y_test = lab[np.array(train_set.targets)], lab[np.array(test_set.targets)]
    bounds = list(range(0, 101, args.step))
    n_tasks = len(bounds) - 1

    net = Backbone(100).to(device)
    model = DDP(net, device_ids=[local_rank])
    old_net, old_biases = None, []
    biases = []
    mem_train, mem_val = {}, {}
    rng = np.random.RandomState(args.seed)
    acc = np.zeros((n_tasks, n_tasks))

    for t in range(n_tasks):
        lo, hi = bounds[t], bounds[t + 1]
        new_tr, new_val = {}, {}
        for c in range(lo, hi):
            new_tr[c], new_val[c] = split_train_val(np.flatnonzero(y_train == c), args.val_ratio, rng)

        # ---------------- stage 1
        idx = [i for c in new_tr for i in new_tr[c]] + [i for c in mem_train for i in mem_train[c]]
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + t)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [100, 150, 200], 0.1)
        lam = lo / hi
        for ep in range(args.epochs):
            model.train()
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x)[:, :hi]
                loss = F.cross_entropy(out, y)
                if old_net is not None:
                    with torch.no_grad():
                        o = old_net(x)[:, :lo]
                        for k, b in enumerate(old_biases, start=1):
                            o = b(o, bounds[k])
                    kd = F.kl_div(F.log_softmax(out[:, :lo] / args.T, 1), F.softmax(o / args.T, 1),
                                  reduction="batchmean") * args.T ** 2
                    loss = (1 - lam) * loss + lam * kd
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            wandb.log({"task": t, "epoch": ep, "stage1/loss": loss.item(), "lr": sched.get_last_lr()[0]})

        # ---------------- stage 2 (bias correction) on rank 0, parameters broadcast
        if t > 0:
            bias = BiasLayer().to(device)
            if rank == 0:
                val_idx = [i for c in new_val for i in new_val[c]] + [i for c in mem_val for i in mem_val[c]]
                vloader = DataLoader(Subset(plain_train, val_idx), batch_size=128, shuffle=True, num_workers=2)
                bopt = torch.optim.SGD(bias.parameters(), lr=0.001, momentum=0.9)
                net.eval()
                for _ in range(args.bias_epochs):
                    for x, y in vloader:
                        x, y = x.to(device), y.to(device)
                        with torch.no_grad():
                            logits = net(x)[:, :hi]
                            for k, b in enumerate(biases, start=1):
                                logits = b(logits, bounds[k])
                        l2 = F.cross_entropy(bias(logits, lo), y)
                        bopt.zero_grad()
                        l2.backward()
                        bopt.step()
                wandb.log({"task": t, "bias/alpha": bias.alpha.item(), "bias/beta": bias.beta.item()})
            for p in bias.parameters():
                dist.broadcast(p.data, src=0)
            biases.append(bias.requires_grad_(False))

        # ---------------- exemplars (random, balanced), same rng on every rank
        per_class = args.memory // hi
        n_val = max(1, int(per_class * args.val_ratio))
        for c in list(mem_train):
            mem_train[c], mem_val[c] = mem_train[c][: per_class - n_val], mem_val[c][:n_val]
        for c in range(lo, hi):
            mem_train[c] = new_tr[c][: per_class - n_val]
            mem_val[c] = new_val[c][:n_val]

        acc[t, : t + 1] = evaluate(net, biases, bounds, test_set, y_test, t, device, rank, world)
        fgt = np.mean([acc[j:t, j].max() - acc[t, j] for j in range(t)]) if t else 0.0
        wandb.log({"task": t, "acc/avg": acc[t, : t + 1].mean(), "acc/forgetting": fgt})
        if rank == 0:
            print(f"task {t}: {np.round(acc[t, :t + 1], 2)} avg {acc[t, :t + 1].mean():.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "biases": [b.state_dict() for b in biases],
                        "acc": acc}, os.path.join(args.out, f"bic_t{t}.pt"))
        dist.barrier()
        old_net = copy.deepcopy(net).eval().requires_grad_(False)
        old_biases = [copy.deepcopy(b) for b in biases]

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
