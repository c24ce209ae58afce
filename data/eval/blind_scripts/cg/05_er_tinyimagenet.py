"""Experience Replay with a growing classifier on class-incremental Tiny-ImageNet.

200 classes in 10 tasks of 20. Memory: a fixed number of exemplars per seen class (random
selection, same seed on every rank so every rank holds the same memory).
Checkpoints are written at the end of every task and can be resumed with --resume.

    torchrun --nproc_per_node=4 05_er_tinyimagenet.py --root /data/tiny-imagenet-200 \
        --out runs/er_tiny --resume runs/er_tiny/task_03.pt
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
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.models import resnet18


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/tiny-imagenet-200")
    ap.add_argument("--out", default="runs/er_tiny")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--mem-per-class", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class Learner(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet18()
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.fc = nn.Identity()
        self.encoder = r
        self.classifier = nn.Linear(512, 0)

    @property
    def n_out(self):
        return self.classifier.out_features

    def add_classes(self, n):
        w, b = self.classifier.weight.data, self.classifier.bias.data
        self.classifier = nn.Linear(512, self.n_out + n).to(w.device)
        self.classifier.weight.data[: w.size(0)] = w
        self.classifier.bias.data[: b.size(0)] = b

    def forward(self, x):
        return self.classifier(self.encoder(x))


def pick_memory(targets, classes, k, seed):
    rng = np.random.RandomState(seed)
    mem = {}
    for c in classes:
        idx = np.flatnonzero(targets == c)
        mem[int(c)] = rng.choice(idx, size=min(k, len(idx)), replace=False).tolist()
    return mem


@torch.no_grad()
def eval_tasks(net, val_set, val_targets, n_tasks_seen, cpt, device):
    net.eval()
    accs = []
    for j in range(n_tasks_seen):
        idx = np.flatnonzero((val_targets >= j * cpt) & (val_targets < (j + 1) * cpt))
        dl = DataLoader(Subset(val_set, idx), batch_size=200, num_workers=4)
        right = n = 0
        for x, y in dl:
            p = net(x.to(device)).argmax(1).cpu()
            right += (p == y).sum().item()
            n += len(y)
        accs.append(100.0 * right / n)
    net.train()
    return accs


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)
    torch.manual_seed(args.seed)

    tf_train = transforms.Compose([transforms.RandomCrop(64, padding=8),
                                   transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(),
                                   transforms.Normalize([0.480, 0.448, 0.398], [0.277, 0.269, 0.282])])
    tf_val = transforms.Compose([transforms.ToTensor(),
                                 transforms.Normalize([0.480, 0.448, 0.398], [0.277, 0.269, 0.282])])
    train_set = ImageFolder(os.path.join(args.root, "train"), tf_train)
    val_set = ImageFolder(os.path.join(args.root, "val"), tf_val)
    train_targets = np.asarray(train_set.targets)
    val_targets = np.asarray(val_set.targets)
    cpt = len(train_set.classes) // args.tasks

    net = Learner().to(dev)
    memory = {}
    R = np.zeros((args.tasks, args.tasks))
    start = 0

    if args.resume:
        with open(args.resume.replace(".pt", ".json")) as f:
            meta = json.load(f)
        start = meta["task"] + 1
        memory = {int(c): v for c, v in meta["memory"].items()}
        R = np.array(meta["R"])
        # weights are only needed on rank 0: DDP broadcasts them to the others
        if rank == 0:
            state = torch.load(args.resume, map_location=dev)
            net.add_classes(state["classifier.weight"].shape[0])
            net.load_state_dict(state)
            print(f"resumed from {args.resume} at task {start}", flush=True)

    for t in range(start, args.tasks):
        net.add_classes(cpt)
        model = DDP(net, device_ids=[lr_])
        new_cls = list(range(t * cpt, (t + 1) * cpt))
        idx = np.flatnonzero(np.isin(train_targets, new_cls)).tolist()
        idx += [i for c in sorted(memory) for i in memory[c]]
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            t0 = time.time()
            for x, y in loader:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            if rank == 0:
                print(f"task {t} ep {ep} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)

        memory.update(pick_memory(train_targets, new_cls, args.mem_per_class, args.seed + t))

        if rank == 0:
            R[t, : t + 1] = eval_tasks(net, val_set, val_targets, t + 1, cpt, dev)
            fgt = np.mean([R[:t, j].max() - R[t, j] for j in range(t)]) if t else 0.0
            print(f"[task {t}] acc {R[t, :t + 1].mean():.2f} forgetting {fgt:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"task_{t:02d}.pt")
            torch.save(net.state_dict(), path)
            with open(path.replace(".pt", ".json"), "w") as f:
                json.dump({"task": t, "memory": memory, "R": R.tolist()}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
