"""LUCIR (Hou et al., CVPR 2019) on CIFAR-100, B50 + 5 steps of 10 classes, mixed precision DDP.

cosine-normalised classifier, less-forget (feature) distillation, inter-class margin ranking.

    torchrun --nproc_per_node=4 11_lucir_cifar100.py --root ./data --save-dir ckpt/lucir_b50_5
"""
import argparse
import copy
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet34

log = logging.getLogger("lucir")


class CosineLinear(nn.Module):
    def __init__(self, dim, n, sigma=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, dim).uniform_(-1 / math.sqrt(dim), 1 / math.sqrt(dim)))
        self.sigma = nn.Parameter(torch.tensor(10.0)) if sigma else None

    def forward(self, f):
        out = F.linear(F.normalize(f, dim=1), F.normalize(self.weight, dim=1))
        return out * self.sigma if self.sigma is not None else out


class LucirNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet34()
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        r.fc = nn.Identity()
        self.body = r
        self.fc = None

    def add_classes(self, n, init_from=None):
        fc = CosineLinear(512, (0 if self.fc is None else self.fc.weight.size(0)) + n)
        if self.fc is not None:
            fc.weight.data[: self.fc.weight.size(0)] = self.fc.weight.data
            fc.sigma.data.copy_(self.fc.sigma.data)
        if init_from is not None:
            fc.weight.data[-n:] = init_from
        self.fc = fc.to(next(self.body.parameters()).device)

    def forward(self, x):
        f = self.body(x)
        return self.fc(f), f


@torch.no_grad()
def features(net, ds, idx, device):
    net.eval()
    out = []
    for x, _ in DataLoader(Subset(ds, idx), batch_size=256, num_workers=4):
        out.append(F.normalize(net(x.to(device))[1].float(), dim=1))
    return torch.cat(out)


def herding(f, m):
    mu, cur, sel = f.mean(0), torch.zeros_like(f[0]), []
    for k in range(1, m + 1):
        d = ((mu - (cur + f) / k) ** 2).sum(1)
        d[sel] = float("inf")
        i = int(d.argmin())
        sel.append(i)
        cur += f[i]
    return sel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--save-dir", default="ckpt/lucir")
    ap.add_argument("--base", type=int, default=50)
    ap.add_argument("--step", type=int, default=10)
    ap.add_argument("--mem-per-class", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--lamda-base", type=float, default=5.0)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--margin", type=float, default=0.5)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(1993)

    order = np.random.RandomState(1993).permutation(100)
    label = np.argsort(order)
    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2009, 0.1984, 0.2023))
    if rank == 0:
        datasets.CIFAR100(args.root, train=True, download=True)
        datasets.CIFAR100(args.root, train=False, download=True)
    dist.barrier()
    to_label = lambda y: int(label[y])
    trainset = datasets.CIFAR100(args.root, True, transforms.Compose([
        transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]),
        target_transform=to_label)
    evalset = datasets.CIFAR100(args.root, True, transforms.Compose([transforms.ToTensor(), norm]),
                                target_transform=to_label)
    testset = datasets.CIFAR100(args.root, False, transforms.Compose([transforms.ToTensor(), norm]),
                                target_transform=to_label)
    ytr, yte = label[np.array(trainset.targets)], label[np.array(testset.targets)]

    steps = [args.base] + [args.step] * ((100 - args.base) // args.step)
    net = LucirNet().to(device)
    ref = None
    memory = {}
    accs = []
    scaler = GradScaler()

    seen = 0
    for s, n_new in enumerate(steps):
        lo, hi = seen, seen + n_new
        init = None
        if ref is not None:
            # imprint new weights with normalised class means of the new classes
            init = torch.stack([features(net, evalset, np.flatnonzero(ytr == c), device).mean(0)
                                for c in range(lo, hi)])
        net.add_classes(n_new, init_from=init)
        model = DDP(net, device_ids=[local_rank])
        idx = np.flatnonzero((ytr >= lo) & (ytr < hi)).tolist() + [i for c in memory for i in memory[c]]
        ds = Subset(trainset, idx)
        sampler = DistributedSampler(ds, shuffle=True)
        loader = DataLoader(ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
        lr = args.lr if s == 0 else args.lr / 10
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [80, 120], 0.1)
        lamda = args.lamda_base * math.sqrt(lo / n_new) if lo else 0.0

        for ep in range(args.epochs):
            model.train()
            sampler.set_epoch(ep)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with autocast():
                    logits, feat = model(x)
                    loss = F.cross_entropy(logits, y)
                    if ref is not None:
                        with torch.no_grad():
                            _, ref_feat = ref(x)
                        loss = loss + lamda * F.cosine_embedding_loss(
                            feat, ref_feat.detach(), torch.ones(x.size(0), device=device))
                        old = y < lo
                        if old.any():
                            cos = logits[old] / net.fc.sigma
                            gt = cos.gather(1, y[old, None])
                            hard = cos[:, lo:hi].topk(args.K, dim=1)[0]
                            loss = loss + F.margin_ranking_loss(
                                gt.expand_as(hard).reshape(-1), hard.reshape(-1),
                                torch.ones(hard.numel(), device=device), margin=args.margin)
                if not torch.isfinite(loss):
                    log.warning("non-finite loss at step %d epoch %d, skipping batch", s, ep)
                    continue
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            if ep % 20 == 0:
                log.info("step %d epoch %d loss %.4f", s, ep, loss.item())

        # herding on rank 0, memory shared with every rank
        payload = [memory]
        if rank == 0:
            for c in range(lo, hi):
                pool = np.flatnonzero(ytr == c)
                memory[c] = pool[herding(features(net, evalset, pool, device), args.mem_per_class)].tolist()
            payload = [memory]
        dist.broadcast_object_list(payload, src=0)
        memory = payload[0]

        # CNN accuracy on all seen classes, scored on rank 0
        if rank == 0:
            net.eval()
            right = 0
            te_idx = np.flatnonzero(yte < hi)
            with torch.no_grad():
                for x, y in DataLoader(Subset(testset, te_idx), batch_size=500, num_workers=4):
                    right += (net(x.to(device))[0].argmax(1).cpu() == y).sum().item()
            accs.append(100 * right / len(te_idx))
            log.info("step %d: acc on %d classes = %.2f  (avg inc %.2f)", s, hi, accs[-1], np.mean(accs))
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "memory": memory, "accs": accs},
                       os.path.join(args.save_dir, f"step{s}.pt"))
        dist.barrier()
        ref = copy.deepcopy(net).eval().requires_grad_(False)
        seen = hi

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
