"""Semi-supervised domain adaptation with Minimax Entropy (MME, Saito et al., ICCV'19).

DomainNet (126-class subset), k labelled target shots per class.  The target
domain is split here into labelled shots / validation / unlabelled (test) images.

    torchrun --nproc_per_node=4 17_mme_ssda_domainnet.py --root /data/domainnet \
        --source real --target clipart --shots 3
"""
import argparse
import os
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

NUM_CLASSES = 126


class Items(Dataset):
    def __init__(self, root, items, transform):
        self.root, self.items, self.transform = root, items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.transform(Image.open(os.path.join(self.root, p)).convert("RGB")), y


def read_list(path):
    with open(path) as f:
        return [(a, int(b)) for a, b in (line.split() for line in f if line.strip())]


def split_target(items, shots, val_per_class):
    by_class = defaultdict(list)
    for it in items:
        by_class[it[1]].append(it)
    labeled, val, unlabeled = [], [], []
    for c in sorted(by_class):
        lst = by_class[c][:]
        random.shuffle(lst)
        labeled += lst[:shots]
        val += lst[shots:shots + val_per_class]
        unlabeled += lst[shots + val_per_class:]
    return labeled, val, unlabeled


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eta):
        ctx.eta = eta
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.eta * g, None


class MMENet(nn.Module):
    def __init__(self, num_classes, temp=0.05):
        super().__init__()
        r = models.resnet34(weights=models.ResNet34_Weights.IMAGENET1K_V1)
        r.fc = nn.Identity()
        self.G = r
        self.proj = nn.Linear(512, 512)
        self.F = nn.Linear(512, num_classes, bias=False)
        nn.init.normal_(self.F.weight, 0, 0.1)
        self.temp = temp

    def classify(self, f):
        w = F.normalize(self.F.weight, dim=1)
        return F.normalize(f, dim=1) @ w.t() / self.temp

    def forward(self, x_lab, x_unl=None, eta=1.0):
        n = x_lab.size(0)
        x = x_lab if x_unl is None else torch.cat([x_lab, x_unl])
        f = self.proj(self.G(x))
        logits_lab = self.classify(f[:n])
        if x_unl is None:
            return logits_lab, None
        logits_unl = self.classify(GradReverse.apply(f[n:], eta))
        return logits_lab, logits_unl


def cycle(loader, sampler):
    e = 0
    while True:
        sampler.set_epoch(e)
        yield from loader
        e += 1


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        logits, _ = model(x.to(device))
        c[0] += (logits.argmax(1) == y.to(device)).sum()
        c[1] += len(y)
    dist.all_reduce(c)
    model.train()
    return 100 * (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/domainnet")
    ap.add_argument("--source", default="real")
    ap.add_argument("--target", default="clipart")
    ap.add_argument("--shots", type=int, default=3)
    ap.add_argument("--val-per-class", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--lamda", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-dir", default="save/mme")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    # independent augmentation streams per process; model init is broadcast by DDP
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    src_items = read_list(os.path.join(args.root, "txt", f"{args.source}_all.txt"))
    tgt_items = read_list(os.path.join(args.root, "txt", f"{args.target}_all.txt"))
    tgt_lab, tgt_val, tgt_unl = split_target(tgt_items, args.shots, args.val_per_class)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize(256), transforms.RandomHorizontalFlip(),
                                   transforms.RandomCrop(224), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])

    def train_loader(items, bs):
        ds = Items(args.root, items, train_tf)
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        return DataLoader(ds, bs, sampler=s, num_workers=args.workers, pin_memory=True, drop_last=True), s

    def eval_loader(items):
        ds = Items(args.root, items, test_tf)
        return DataLoader(ds, 128, sampler=DistributedSampler(ds, shuffle=False), num_workers=args.workers)

    src_loader, src_s = train_loader(src_items, args.batch_size)
    lab_loader, lab_s = train_loader(tgt_lab, max(1, min(args.batch_size, len(tgt_lab) // dist.get_world_size())))
    unl_loader, unl_s = train_loader(tgt_unl, 2 * args.batch_size)
    val_loader, test_loader = eval_loader(tgt_val), eval_loader(tgt_unl)

    model = MMENet(NUM_CLASSES).to(device)
    optimizer = torch.optim.SGD([
        {"params": model.G.parameters(), "lr": 0.1 * args.lr},
        {"params": list(model.proj.parameters()) + list(model.F.parameters()), "lr": args.lr},
    ], momentum=0.9, weight_decay=5e-4, nesterov=True)
    lr0 = [g["lr"] for g in optimizer.param_groups]
    model = DDP(model, device_ids=[local_rank])

    src_it, lab_it, unl_it = cycle(src_loader, src_s), cycle(lab_loader, lab_s), cycle(unl_loader, unl_s)
    best_val, test_at_best = 0.0, 0.0
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"target split: {len(tgt_lab)} labelled / {len(tgt_val)} val / {len(tgt_unl)} unlabelled", flush=True)

    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g, lr in zip(optimizer.param_groups, lr0):
            g["lr"] = lr * (1 + 1e-4 * step) ** -0.75
        xs, ys = next(src_it)
        xl, yl = next(lab_it)
        xu, _ = next(unl_it)
        x_lab = torch.cat([xs, xl]).to(device, non_blocking=True)
        y_lab = torch.cat([ys, yl]).to(device, non_blocking=True)
        xu = xu.to(device, non_blocking=True)

        logits_lab, logits_unl = model(x_lab, xu, eta=1.0)
        ce = F.cross_entropy(logits_lab, y_lab)
        p = F.softmax(logits_unl, 1)
        # classifier maximises entropy on unlabelled target; GRL makes G minimise it
        neg_ent = (p * torch.log(p + 1e-5)).sum(1).mean()
        loss = ce + args.lamda * neg_ent

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if step % 100 == 0:
            v = torch.stack([ce.detach(), -neg_ent.detach()])
            dist.all_reduce(v, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step}: ce {v[0]:.4f} ent {v[1]:.4f} ({time.time() - t0:.0f}s)", flush=True)

        if step % args.eval_every == 0:
            val_acc = accuracy(model, val_loader, device)
            test_acc = accuracy(model, test_loader, device)
            if rank == 0:
                print(f"step {step}: val {val_acc:.2f} test {test_acc:.2f}", flush=True)
                if val_acc >= best_val:
                    best_val, test_at_best = val_acc, test_acc
                    torch.save({"model": model.module.state_dict(), "step": step,
                                "val": val_acc, "test": test_acc},
                               os.path.join(args.save_dir, f"{args.source}_{args.target}_{args.shots}shot.pth"))
            dist.barrier()

    if rank == 0:
        print(f"best val {best_val:.2f} -> test {test_at_best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
