"""ViT with expert-choice MoE layers (Zhou et al. 2022) on a folder-of-images dataset.

Each expert picks its top-C tokens instead of tokens picking experts, so load is
balanced by construction; we still log how many tokens got no expert at all.

    torchrun --nproc_per_node=4 11_vit_moe_plants.py --root /data/plantvillage --num-classes 38
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--num-classes", type=int, required=True)
    p.add_argument("--img", type=int, default=128)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=2.0)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--save", default="checkpoints/vit_ec_moe")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ExpertChoiceMoE(nn.Module):
    def __init__(self, dim, n_experts, capacity_factor):
        super().__init__()
        self.E, self.cf = n_experts, capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, 4 * dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, 4 * dim, dim))
        nn.init.xavier_uniform_(self.w1)
        nn.init.xavier_uniform_(self.w2)

    def forward(self, x):
        B, N, D = x.shape
        tokens = x.reshape(B * N, D)
        S = tokens.size(0)
        C = min(S, int(math.ceil(S * self.cf / self.E)))
        scores = self.router(tokens).float().softmax(dim=-1)          # [S, E]
        gate, idx = scores.t().topk(C, dim=-1)                        # [E, C]
        xin = tokens[idx]                                             # [E, C, D]
        h = F.gelu(torch.bmm(xin, self.w1.to(xin.dtype)))
        h = torch.bmm(h, self.w2.to(h.dtype)) * gate[..., None].to(h.dtype)
        out = torch.zeros_like(tokens).index_add_(0, idx.reshape(-1), h.reshape(-1, D).to(tokens.dtype))
        hit = torch.zeros(S, device=x.device).index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), device=x.device))
        unrouted = (hit == 0).float().mean()
        return out.view(B, N, D), unrouted


class Block(nn.Module):
    def __init__(self, dim, heads, moe, a):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.is_moe = moe
        self.ffn = ExpertChoiceMoE(dim, a.experts, a.capacity_factor) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.is_moe:
            y, unrouted = self.ffn(self.ln2(x))
            return x + y, unrouted
        return x + self.ffn(self.ln2(x)), None


class ViTMoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        n = (a.img // a.patch) ** 2
        self.embed = nn.Conv2d(3, a.dim, a.patch, a.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, a.dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, a.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads, i % 2 == 1, a) for i in range(a.depth))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.num_classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        unrouted = []
        for b in self.blocks:
            x, u = b(x)
            if u is not None:
                unrouted.append(u)
        return self.head(self.norm(x[:, 0])), torch.stack(unrouted).mean()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation / dropout randomness on each rank; DDP syncs the weights from rank 0
    torch.manual_seed(a.seed + rank)

    train_tf = T.Compose([T.RandomResizedCrop(a.img, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])
    eval_tf = T.Compose([T.Resize(int(a.img * 1.14)), T.CenterCrop(a.img), T.ToTensor(),
                         T.Normalize([0.5] * 3, [0.5] * 3)])
    full_train = datasets.ImageFolder(a.root, transform=train_tf)
    full_eval = datasets.ImageFolder(a.root, transform=eval_tf)
    n_val = int(len(full_train) * a.val_frac)
    train_part, val_part = random_split(range(len(full_train)), [len(full_train) - n_val, n_val])
    train_set = Subset(full_train, list(train_part))
    val_set = Subset(full_eval, list(val_part))

    sampler = DistributedSampler(train_set, shuffle=True, seed=a.seed, drop_last=True)
    train_loader = DataLoader(train_set, a.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, 256, shuffle=False, num_workers=4, pin_memory=True)

    model = DDP(ViTMoE(a).to(device), device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos" not in n and "cls" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "pos" not in n and "cls" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr)
    iters = len(train_loader)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=a.warmup_epochs * iters),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, (a.epochs - a.warmup_epochs) * iters, eta_min=1e-6),
    ], milestones=[a.warmup_epochs * iters])

    if rank == 0:
        os.makedirs(a.save, exist_ok=True)
        print(f"train {len(train_set)} val {len(val_set)} classes {a.num_classes} world {world}")

    best = 0.0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(3, device=device)
        for img, y in train_loader:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, unrouted = model(img)
                loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach().float(), unrouted.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for img, y in val_loader:
                img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, _ = model.module(img)
                acc[0] += (logits.argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        top1 = (acc[0] / acc[1]).item() * 100

        if rank == 0:
            print(f"epoch {epoch:3d} loss {run[0] / run[2]:.4f} unrouted {run[1] / run[2]:.3%} "
                  f"val top1 {top1:.2f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "top1": top1, "args": vars(a)}
            torch.save(ckpt, os.path.join(a.save, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(ckpt, os.path.join(a.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
