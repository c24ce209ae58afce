"""Soft-MoE ViT (Puigcerver et al. 2023) on CIFAR-100, trained with DDP.

Every expert processes a fixed number of slots, each slot a softmax-weighted mix
of all tokens, so nothing is dropped; we log the dispatch entropy per layer as a
proxy for how specialised the slots become.

    torchrun --nproc_per_node=4 17_vmoe_cifar100.py --data ./data --epochs 200
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/softmoe_c100")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=9)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class SoftMoE(nn.Module):
    def __init__(self, dim, n_experts, slots_per_expert):
        super().__init__()
        self.E, self.S = n_experts, slots_per_expert
        self.phi = nn.Parameter(torch.randn(dim, n_experts * slots_per_expert) / dim ** 0.5)
        self.scale = nn.Parameter(torch.ones(()))
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, 4 * dim) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(n_experts, 1, 4 * dim))
        self.w2 = nn.Parameter(torch.randn(n_experts, 4 * dim, dim) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(n_experts, 1, dim))

    def forward(self, x):
        B, N, D = x.shape
        xn = F.normalize(x, dim=-1)
        phi = self.scale * F.normalize(self.phi, dim=0)
        logits = torch.einsum("bnd,dm->bnm", xn, phi.to(xn.dtype)).float()   # [B, N, E*S]
        dispatch = logits.softmax(dim=1)                                     # over tokens
        combine = logits.softmax(dim=2)                                      # over slots
        slots = torch.einsum("bnm,bnd->bmd", dispatch.to(x.dtype), x)        # [B, E*S, D]
        slots = slots.view(B, self.E, self.S, D).transpose(0, 1).reshape(self.E, B * self.S, D)
        h = F.gelu(torch.baddbmm(self.b1.to(slots.dtype), slots, self.w1.to(slots.dtype)))
        h = torch.baddbmm(self.b2.to(h.dtype), h, self.w2.to(h.dtype))
        h = h.view(self.E, B, self.S, D).transpose(0, 1).reshape(B, self.E * self.S, D)
        out = torch.einsum("bnm,bmd->bnd", combine.to(h.dtype), h)
        ent = -(dispatch * dispatch.clamp_min(1e-9).log()).sum(1).mean()
        return out, ent.detach()


class Block(nn.Module):
    def __init__(self, dim, heads, moe, a):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = moe
        self.mlp = SoftMoE(dim, a.experts, a.slots) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.moe:
            y, ent = self.mlp(self.norm2(x))
            return x + y, ent
        return x + self.mlp(self.norm2(x)), None


class SoftMoEViT(nn.Module):
    def __init__(self, a, num_classes=100, img=32):
        super().__init__()
        n = (img // a.patch) ** 2
        self.patch_embed = nn.Conv2d(3, a.dim, a.patch, a.patch)
        self.pos = nn.Parameter(torch.randn(1, n, a.dim) * 0.02)
        # second half of the network is MoE, as in the paper
        self.blocks = nn.ModuleList(Block(a.dim, a.heads, i >= a.depth // 2, a) for i in range(a.depth))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, num_classes)

    def forward(self, img):
        x = self.patch_embed(img).flatten(2).transpose(1, 2) + self.pos
        ents = []
        for b in self.blocks:
            x, e = b(x)
            if e is not None:
                ents.append(e)
        return self.head(self.norm(x).mean(1)), torch.stack(ents)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.AutoAugment(transforms.AutoAugmentPolicy.CIFAR10), transforms.ToTensor(),
        transforms.Normalize(mean, std), transforms.RandomErasing(0.25)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        datasets.CIFAR100(a.data, train=True, download=True)
        datasets.CIFAR100(a.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(a.data, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(a.data, train=False, transform=test_tf)

    train_loader = DataLoader(train_set, batch_size=a.bs, shuffle=True, num_workers=a.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=500, sampler=test_sampler, num_workers=a.workers, pin_memory=True)

    model = DDP(SoftMoEViT(a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    steps = a.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=steps,
                                                pct_start=a.warmup / a.epochs, anneal_strategy="cos")
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
    best = 0.0
    for epoch in range(a.epochs):
        model.train()
        t0 = time.time()
        tr = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ents = model(x)
                loss = criterion(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach().float() * y.size(0), (logits.argmax(1) == y).sum().float(),
                               torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(tr)

        model.eval()
        te = torch.zeros(2, device=device)
        ent_sum = torch.zeros(len(ents), device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, ents = model(x)
                te[0] += (logits.argmax(1) == y).sum()
                te[1] += y.numel()
                ent_sum += ents.float()
        dist.all_reduce(te)
        dist.all_reduce(ent_sum)
        acc = (te[0] / te[1]).item() * 100
        if rank == 0:
            ent_str = " ".join(f"{v:.2f}" for v in (ent_sum / (world * len(test_loader))).tolist())
            print(f"epoch {epoch:3d} | train loss {tr[0] / tr[2]:.3f} acc {100 * tr[1] / tr[2]:.2f} | "
                  f"test acc {acc:.2f} | dispatch entropy [{ent_str}] | {time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(a.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(a.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best test acc {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
