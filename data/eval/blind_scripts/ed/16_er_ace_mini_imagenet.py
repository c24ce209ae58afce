"""ER-ACE (Caccia et al., ICLR 2022) on online Split mini-ImageNet (20 tasks x 5 classes).

Asymmetric cross-entropy: the incoming batch is only trained against the
classes present in it, the replayed batch against all classes seen so far.
Single pass over the stream; after each task the full accuracy matrix row is
computed and the final average accuracy / forgetting are written to disk.

    torchrun --nproc_per_node=4 16_er_ace_mini_imagenet.py --root /data/miniimagenet --mem_size 10000
"""
import argparse
import json
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
from torchvision import datasets, models, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/miniimagenet")
    ap.add_argument("--out", default="./results/er_ace_mini")
    ap.add_argument("--n_tasks", type=int, default=20)
    ap.add_argument("--batch_size", type=int, default=10, help="stream batch per GPU")
    ap.add_argument("--buffer_batch_size", type=int, default=10)
    ap.add_argument("--mem_size", type=int, default=10000, help="total over ranks")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--n_iters", type=int, default=1, help="updates per incoming batch")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Reservoir:
    def __init__(self, capacity, shape, device):
        self.bx = torch.zeros(capacity, *shape, device=device)
        self.by = torch.zeros(capacity, dtype=torch.long, device=device)
        self.capacity, self.n_seen = capacity, 0

    def __len__(self):
        return min(self.capacity, self.n_seen)

    def add(self, x, y):
        for i in range(x.size(0)):
            slot = self.n_seen if self.n_seen < self.capacity else random.randint(0, self.n_seen)
            if slot < self.capacity:
                self.bx[slot], self.by[slot] = x[i], y[i]
            self.n_seen += 1

    def sample(self, n):
        idx = torch.randperm(len(self), device=self.bx.device)[:n]
        return self.bx[idx], self.by[idx]


def make_net(n_classes):
    net = models.resnet18(num_classes=n_classes)
    net.maxpool = nn.Identity()
    return net


@torch.no_grad()
def evaluate(net, loaders, seen_classes, device):
    net.eval()
    mask = torch.full((100,), -1e9, device=device)
    mask[seen_classes] = 0
    accs = []
    for loader in loaders:
        correct = total = 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += ((net(x) + mask).argmax(1) == y).sum().item()
            total += y.size(0)
        accs.append(100.0 * correct / total)
    return accs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tf = transforms.Compose([transforms.Resize((84, 84)), transforms.ToTensor(),
                             transforms.Normalize((0.4729, 0.4487, 0.4030), (0.2833, 0.2752, 0.2886))])
    train_set = datasets.ImageFolder(os.path.join(args.root, "train"), tf)
    test_set = datasets.ImageFolder(os.path.join(args.root, "test"), tf)
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    order = np.random.RandomState(args.seed).permutation(100)
    cpt = 100 // args.n_tasks
    tasks = [order[k * cpt:(k + 1) * cpt].tolist() for k in range(args.n_tasks)]

    test_loaders = []
    for classes in tasks:
        sub = Subset(test_set, np.where(np.isin(y_test, classes))[0].tolist())
        test_loaders.append(DataLoader(sub, batch_size=256, sampler=DistributedSampler(sub, shuffle=False),
                                       num_workers=4, pin_memory=True))

    net = make_net(100).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world)
    buffer = Reservoir(args.mem_size // world, (3, 84, 84), device)
    acc = np.zeros((args.n_tasks, args.n_tasks))
    seen = []

    for t, classes in enumerate(tasks):
        seen += classes
        seen_mask = torch.full((100,), -1e9, device=device)
        seen_mask[seen] = 0
        stream = Subset(train_set, np.where(np.isin(y_train, classes))[0].tolist())
        sampler = DistributedSampler(stream, shuffle=True, seed=args.seed)
        sampler.set_epoch(t)
        loader = DataLoader(stream, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        model.train()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            present = torch.zeros(100, dtype=torch.bool, device=device)
            present[y] = True
            for _ in range(args.n_iters):
                if len(buffer):
                    bx, by = buffer.sample(args.buffer_batch_size)
                    logits = model(torch.cat([x, bx]))
                else:
                    logits = model(x)
                inc_logits = logits[: x.size(0)].masked_fill(~present, -1e9)
                loss = F.cross_entropy(inc_logits, y)
                if len(buffer):
                    loss = loss + F.cross_entropy(logits[x.size(0):] + seen_mask, by)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            buffer.add(x, y)
            if rank == 0 and step % 100 == 0:
                print(f"task {t} step {step}/{len(loader)} loss {loss.item():.3f}", flush=True)

        row = evaluate(net, test_loaders[:t + 1], seen, device)
        acc[t, :t + 1] = row
        if rank == 0:
            print(f"[task {t}] avg acc {np.mean(row):.2f} | " + " ".join(f"{a:.1f}" for a in row), flush=True)

    if rank == 0:
        final_acc = acc[-1].mean()
        forgetting = np.mean([acc[:-1, j].max() - acc[-1, j] for j in range(args.n_tasks - 1)])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"seed{args.seed}.json"), "w") as f:
            json.dump({"acc_matrix": acc.tolist(), "final_avg_acc": final_acc, "forgetting": forgetting,
                       "world_size": world, "args": vars(args)}, f, indent=2)
        torch.save(net.state_dict(), os.path.join(args.out, f"seed{args.seed}_final.pt"))
        print(f"final avg acc {final_acc:.2f}, forgetting {forgetting:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
