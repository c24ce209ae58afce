"""Synaptic Intelligence (Zenke et al., ICML 2017), multi-head Split CIFAR-100.

Task-incremental: one 10-way head per task, all heads built up front, only the
head of the current task is used in a training step. Supports resuming from
the checkpoint written at the end of a task.

    torchrun --standalone --nproc_per_node=4 12_si_multihead_resume.py --c 0.1
    torchrun --standalone --nproc_per_node=4 12_si_multihead_resume.py --resume out/si/last.pt
"""
import argparse
import logging
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

logger = logging.getLogger(__name__)


class ConvNet(nn.Module):
    """The 4-conv + 2-fc network of the SI paper, with one head per task."""

    def __init__(self, n_tasks, n_out):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout(0.25), nn.Flatten(),
            nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Dropout(0.5),
        )
        self.heads = nn.ModuleList([nn.Linear(512, n_out) for _ in range(n_tasks)])

    def forward(self, x, task):
        return self.heads[task](self.features(x))


class SI:
    def __init__(self, net, c, xi):
        self.c, self.xi = c, xi
        self.params = {n: p for n, p in net.named_parameters() if not n.startswith("heads.")}
        self.omega = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.anchor = {n: p.detach().clone() for n, p in self.params.items()}
        self.start_task()

    def start_task(self):
        self.w = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.prev = {n: p.detach().clone() for n, p in self.params.items()}
        self.task_start = {n: p.detach().clone() for n, p in self.params.items()}

    def penalty(self):
        return self.c * sum((self.omega[n] * (p - self.anchor[n]) ** 2).sum() for n, p in self.params.items())

    @torch.no_grad()
    def accumulate(self):
        # called after optimizer.step(): grads are the all-reduced ones, identical on every rank
        for n, p in self.params.items():
            if p.grad is not None:
                self.w[n] -= p.grad * (p - self.prev[n])
            self.prev[n] = p.detach().clone()

    @torch.no_grad()
    def consolidate(self):
        for n, p in self.params.items():
            delta = p - self.task_start[n]
            self.omega[n] += self.w[n] / (delta ** 2 + self.xi)
            self.anchor[n] = p.detach().clone()

    def state_dict(self):
        return {"omega": self.omega, "anchor": self.anchor}

    def load_state_dict(self, sd):
        self.omega, self.anchor = sd["omega"], sd["anchor"]


@torch.no_grad()
def evaluate(net, test_set, y_test, tasks, rank, world, device):
    net.eval()
    res = torch.zeros(len(tasks), 2, device=device)
    for t, classes in enumerate(tasks):
        idx = np.where(np.isin(y_test, classes))[0][rank::world]
        local = {c: i for i, c in enumerate(classes)}
        for x, y in DataLoader(Subset(test_set, idx.tolist()), batch_size=500, num_workers=2):
            y = torch.tensor([local[int(v)] for v in y], device=device)
            res[t, 0] += (net(x.to(device), t).argmax(1) == y).sum()
            res[t, 1] += len(y)
    dist.all_reduce(res, op=dist.ReduceOp.SUM)
    return (100.0 * res[:, 0] / res[:, 1]).cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./out/si")
    ap.add_argument("--n_tasks", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=256, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--c", type=float, default=0.1)
    ap.add_argument("--xi", type=float, default=1e-3)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    tf_train = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))])
    tf_test = transforms.Compose([transforms.ToTensor(),
                                  transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))])
    train_set = datasets.CIFAR100(args.data, train=True, transform=tf_train)
    test_set = datasets.CIFAR100(args.data, train=False, transform=tf_test)
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    cpt = 100 // args.n_tasks
    tasks = [list(range(t * cpt, (t + 1) * cpt)) for t in range(args.n_tasks)]

    net = ConvNet(args.n_tasks, cpt).to(device)
    si = SI(net, args.c, args.xi)
    start_task, acc = 0, np.zeros((args.n_tasks, args.n_tasks))
    if args.resume:
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{local_rank}"}, weights_only=False)
        net.load_state_dict(ckpt["model"])
        si.load_state_dict(ckpt["si"])
        start_task, acc = ckpt["task"] + 1, ckpt["acc"]
        logger.info("resumed from %s, starting at task %d", args.resume, start_task)
    # the heads of the other tasks get no gradient in a step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    for t in range(start_task, args.n_tasks):
        local = {c: i for i, c in enumerate(tasks[t])}
        train_set.target_transform = local.get
        data = Subset(train_set, np.where(np.isin(y_train, tasks[t]))[0].tolist())
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                            pin_memory=True)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
        si.start_task()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x, t), y)
                if t > 0:
                    loss = loss + si.penalty()
                opt.zero_grad()
                loss.backward()
                opt.step()
                si.accumulate()
            if epoch % 10 == 0:
                logger.info("task %d epoch %d loss %.4f", t, epoch, loss.item())
        si.consolidate()

        acc[t, :t + 1] = evaluate(model.module, test_set, y_test, tasks[:t + 1], rank, world, device)
        logger.info("task %d: mean acc %.2f | %s", t, acc[t, :t + 1].mean(), np.round(acc[t, :t + 1], 1))
        if rank == 0:
            torch.save({"task": t, "model": model.module.state_dict(), "si": si.state_dict(), "acc": acc},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        np.savetxt(os.path.join(args.out, "acc.csv"), acc, delimiter=",", fmt="%.2f")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
