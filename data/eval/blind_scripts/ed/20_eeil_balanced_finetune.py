"""End-to-End Incremental Learning (EEIL, Castro et al., ECCV 2018) on CIFAR-100.

Per task: (1) cross-distilled training on new data + exemplars, (2) balanced
fine-tuning on a class-balanced subset with a small learning rate. Exemplars:
fixed total memory, herding replaced by random selection for speed.

    torchrun --nproc_per_node=4 20_eeil_balanced_finetune.py --increment 10 --memory 2000
"""
import argparse
import copy
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def save_checkpoint(state, is_best, out_dir, filename="checkpoint.pth.tar"):
    path = os.path.join(out_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth.tar"))


def make_model():
    net = torchvision.models.resnet34(num_classes=100)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


def run_epoch(model, old_net, loader, opt, n_old, n_seen, T, device):
    model.train()
    meter = AverageMeter()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)[:, :n_seen]
        loss = F.cross_entropy(logits, y)
        if old_net is not None and n_old > 0:
            with torch.no_grad():
                old = old_net(x)[:, :n_old]
            loss = loss + F.kl_div(F.log_softmax(logits[:, :n_old] / T, 1), F.softmax(old / T, 1),
                                   reduction="batchmean") * T * T
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        meter.update(loss.item(), y.size(0))
    return meter.avg


@torch.no_grad()
def test_row(net, test_set, y_test, bounds, t, rank, world, device):
    net.eval()
    s = torch.zeros(t + 1, 2, device=device)
    idx = np.where(y_test < bounds[t + 1])[0][rank::world].tolist()
    for x, y in DataLoader(Subset(test_set, idx), batch_size=500, num_workers=4):
        x, y = x.to(device), y.to(device)
        pred = net(x)[:, :bounds[t + 1]].argmax(1)
        task_id = torch.bucketize(y, torch.tensor(bounds[1:t + 1], device=device), right=True)
        s[:, 0] += torch.bincount(task_id[pred == y], minlength=t + 1).float()
        s[:, 1] += torch.bincount(task_id, minlength=t + 1).float()
    dist.all_reduce(s)
    return (100 * s[:, 0] / s[:, 1]).cpu().numpy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out_dir", default="./runs/eeil")
    parser.add_argument("--increment", type=int, default=10)
    parser.add_argument("--memory", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--bft_epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bft_lr", type=float, default=0.01)
    parser.add_argument("--batch_size", type=int, default=128, help="global")
    parser.add_argument("--T", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1993)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    dist.barrier()

    norm = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
         transforms.ColorJitter(0.25, 0.25, 0.25), transforms.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR100(args.data, train=False,
                                             transform=transforms.Compose([transforms.ToTensor(), norm]))
    remap = np.argsort(np.random.RandomState(args.seed).permutation(100))
    train_set.targets = remap[np.asarray(train_set.targets)].tolist()
    test_set.targets = remap[np.asarray(test_set.targets)].tolist()
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    bounds = list(range(0, 101, args.increment))
    n_tasks = len(bounds) - 1

    net = make_model().to(device)
    model = DDP(net, device_ids=[local_rank])
    old_net, memory = None, {}
    acc = np.zeros((n_tasks, n_tasks))
    best_avg = 0.0
    bs = args.batch_size // world

    for t in range(n_tasks):
        lo, hi = bounds[t], bounds[t + 1]
        new_idx = np.where((y_train >= lo) & (y_train < hi))[0].tolist()
        data = Subset(train_set, new_idx + [i for c in sorted(memory) for i in memory[c]])
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [10, 20, 30], 0.1)
        tic = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            loss = run_epoch(model, old_net, loader, opt, lo, hi, args.T, device)
            sched.step()
            if rank == 0 and epoch % 10 == 0:
                print(f"task {t} epoch {epoch} loss {loss:.4f} ({time.time() - tic:.0f}s)", flush=True)

        # new exemplars (random, seeded -> same everywhere); old sets shrink to the new per-class budget
        m = args.memory // hi
        rng = np.random.RandomState(args.seed + t)
        memory = {c: v[:m] for c, v in memory.items()}
        for c in range(lo, hi):
            memory[c] = rng.choice(np.where(y_train == c)[0], m, replace=False).tolist()

        # balanced fine-tuning (only after the first task)
        if t > 0:
            bal = Subset(train_set, [i for c in sorted(memory) for i in memory[c]])
            bal_sampler = DistributedSampler(bal, shuffle=True, seed=args.seed)
            bal_loader = DataLoader(bal, batch_size=bs, sampler=bal_sampler, num_workers=4, pin_memory=True,
                                    drop_last=True)
            ft_teacher = copy.deepcopy(net).eval().requires_grad_(False)
            bft_opt = torch.optim.SGD(model.parameters(), lr=args.bft_lr, momentum=0.9, weight_decay=1e-4)
            for epoch in range(args.bft_epochs):
                bal_sampler.set_epoch(epoch)
                # EEIL distils the new classes too during BFT, from the model before fine-tuning
                run_epoch(model, ft_teacher, bal_loader, bft_opt, hi, hi, args.T, device)

        acc[t, :t + 1] = test_row(net, test_set, y_test, bounds, t, rank, world, device)
        avg = acc[t, :t + 1].mean()
        if rank == 0:
            print(f"== task {t}: avg inc acc {avg:.2f} | per task {np.round(acc[t, :t + 1], 1).tolist()}",
                  flush=True)
        is_best = t == 0 or avg > best_avg
        best_avg = max(best_avg, avg)
        save_checkpoint({"task": t, "state_dict": net.state_dict(), "memory": memory, "acc": acc},
                        is_best, args.out_dir, filename=f"eeil_task{t}.pth.tar")
        old_net = copy.deepcopy(net).eval().requires_grad_(False)

    if rank == 0:
        np.savetxt(os.path.join(args.out_dir, "acc.txt"), acc, fmt="%.2f")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
