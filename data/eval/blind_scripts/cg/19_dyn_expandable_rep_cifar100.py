"""Dynamically Expandable Representation (DER, Yan et al. CVPR 2021), simplified:
one new ResNet-18 feature extractor per task, older extractors frozen, a classifier over the
concatenated features and an auxiliary (n_new + 1)-way head on the new features.
Class-incremental CIFAR-100, 10 tasks, 2000 exemplars.

    torchrun --nproc_per_node=4 19_dyn_expandable_rep_cifar100.py --out runs/der_c100_10s --seed 1993
"""
import argparse
import copy
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
from torchvision.models import resnet18


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def small_resnet18():
    m = resnet18()
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    m.fc = nn.Identity()
    return m


class ExpandableNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.extractors = nn.ModuleList()
        self.fc = None
        self.aux = None
        self.n_classes = 0

    def add_task(self, n_new):
        ext = small_resnet18()
        if len(self.extractors):
            ext.load_state_dict(self.extractors[-1].state_dict())
            for e in self.extractors:
                e.requires_grad_(False)
        self.extractors.append(ext)
        dim = 512 * len(self.extractors)
        fc = nn.Linear(dim, self.n_classes + n_new)
        if self.fc is not None:
            with torch.no_grad():
                fc.weight.zero_()
                fc.weight[: self.n_classes, : dim - 512] = self.fc.weight
                fc.bias[: self.n_classes] = self.fc.bias
        self.fc = fc
        self.aux = nn.Linear(512, n_new + 1) if self.n_classes > 0 else None
        self.n_classes += n_new

    def train(self, mode=True):
        super().train(mode)
        for e in self.extractors[:-1]:
            e.eval()  # frozen extractors keep their BN statistics
        return self

    def forward(self, x):
        feats = [e(x) for e in self.extractors]
        f = torch.cat(feats, 1)
        return self.fc(f), (self.aux(feats[-1]) if self.aux is not None else None)


@torch.no_grad()
def evaluate(net, test_set, y_test, upto, cpt, device, rank, world):
    net.eval()
    out = []
    for j in range(upto + 1):
        idx = np.flatnonzero((y_test >= j * cpt) & (y_test < (j + 1) * cpt))[rank::world]
        c = torch.zeros(2, device=device)
        for x, y in DataLoader(Subset(test_set, idx), batch_size=256, num_workers=2):
            x, y = x.to(device), y.to(device)
            c[0] += (net(x)[0].argmax(1) == y).sum()
            c[1] += y.numel()
        dist.all_reduce(c)
        out.append((100 * c[0] / c[1]).item())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/der")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--memory", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=170)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different augmentation / dropout streams on each rank
    seed_everything(args.seed + rank)

    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2673, 0.2564, 0.2762))
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    class_order = np.random.permutation(100)
    label_of = np.argsort(class_order)
    to_lab = lambda y: int(label_of[y])
    train_set = datasets.CIFAR100(args.data, True, transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(brightness=63 / 255), transforms.ToTensor(), norm]), target_transform=to_lab)
    test_set = datasets.CIFAR100(args.data, False, transforms.Compose([transforms.ToTensor(), norm]),
                                 target_transform=to_lab)
    y_train, y_test = label_of[np.array(train_set.targets)], label_of[np.array(test_set.targets)]
    cpt = 100 // args.tasks

    net = ExpandableNet()
    memory = {}
    mem_rng = np.random.RandomState(args.seed)
    acc = np.zeros((args.tasks, args.tasks))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print("class order:", class_order.tolist(), flush=True)

    for t in range(args.tasks):
        lo, hi = t * cpt, (t + 1) * cpt
        net.add_task(cpt)
        net.to(device)
        model = DDP(net, device_ids=[local_rank])
        idx = np.flatnonzero((y_train >= lo) & (y_train < hi)).tolist() + \
            [i for c in sorted(memory) for i in memory[c]]
        ds = Subset(train_set, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

        for ep in range(args.epochs):
            model.train()
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, aux_logits = model(x)
                loss = F.cross_entropy(logits, y)
                if aux_logits is not None:
                    aux_y = torch.where(y >= lo, y - lo + 1, torch.zeros_like(y))
                    loss = loss + args.aux_weight * F.cross_entropy(aux_logits, aux_y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0 and ep % 10 == 0:
                print(f"task {t} ep {ep} loss {loss.item():.4f}", flush=True)

        per_class = args.memory // hi
        for c in list(memory):
            memory[c] = memory[c][:per_class]
        for c in range(lo, hi):
            memory[c] = mem_rng.choice(np.flatnonzero(y_train == c), per_class, replace=False).tolist()

        acc[t, : t + 1] = evaluate(net, test_set, y_test, t, cpt, device, rank, world)
        if rank == 0:
            fgt = np.mean([acc[j:t, j].max() - acc[t, j] for j in range(t)]) if t else 0.0
            print(f"== task {t}: avg acc {acc[t, :t + 1].mean():.2f}  forgetting {fgt:.2f}  "
                  f"params {sum(p.numel() for p in net.parameters()) / 1e6:.1f}M", flush=True)
            torch.save({"model": net.state_dict(), "task": t, "memory": memory, "acc": acc,
                        "class_order": class_order}, os.path.join(args.out, f"task{t}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
