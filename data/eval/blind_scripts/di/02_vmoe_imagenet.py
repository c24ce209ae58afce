"""V-MoE style training on ImageNet-1k (conv stem + ViT-S with sparse MoE MLPs).

Experts are replicated on every GPU (plain data parallel); routing uses batch
prioritized routing (BPR) so tokens with the highest gate weight claim the
capacity slots first.

    torchrun --nproc_per_node=8 02_vmoe_imagenet.py --data /datasets/imagenet --epochs 90
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser("vmoe")
    ap.add_argument("--data", default="/datasets/imagenet")
    ap.add_argument("--output", default="runs/vmoe_s16")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=1.05)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-wandb", action="store_true")
    return ap.parse_args()


class ConvStem(nn.Module):
    """Four stride-2 3x3 convs (Xiao et al. 2021) instead of a 16x16 patchify."""

    def __init__(self, dim):
        super().__init__()
        chans = [3, dim // 8, dim // 4, dim // 2, dim]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        layers.append(nn.Conv2d(dim, dim, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).flatten(2).transpose(1, 2)


class SparseMoE(nn.Module):
    def __init__(self, dim, hidden, n_experts, k, capacity_factor):
        super().__init__()
        self.n_experts, self.k, self.cf = n_experts, k, capacity_factor
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n_experts))
        self.last_load = None
        self.last_dropped = None

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        N, E, K = xf.size(0), self.n_experts, self.k
        probs = self.gate(xf).float().softmax(-1)
        w, idx = probs.topk(K, dim=-1)

        # importance + load auxiliary loss
        importance = probs.sum(0)
        load = F.one_hot(idx, E).float().sum((0, 1))
        cv2 = lambda v: v.var() / (v.mean() ** 2 + 1e-10)
        aux = 0.5 * (cv2(importance) + cv2(load))

        # batch prioritized routing: highest max-gate tokens first
        priority = torch.argsort(w[:, 0], descending=True)
        idx_p, w_p = idx[priority], w[priority]
        flat_e = idx_p.t().reshape(-1)
        flat_w = w_p.t().reshape(-1)
        flat_t = priority.repeat(K)
        cap = int(math.ceil(self.cf * N * K / E))
        slot = (F.one_hot(flat_e, E).cumsum(0) - 1).gather(1, flat_e[:, None]).squeeze(1)
        keep = slot < cap

        e_kept = flat_e[keep]
        order = torch.argsort(e_kept, stable=True)
        tok = flat_t[keep][order]
        wt = flat_w[keep][order]
        counts = torch.bincount(e_kept, minlength=E)

        # every expert is run (possibly on zero rows) so all of them stay in the graph
        chunks = xf[tok].split(counts.tolist())
        h = torch.cat([expert(c) for expert, c in zip(self.experts, chunks)], dim=0)
        y = torch.zeros_like(xf)
        y.index_add_(0, tok, (h * wt[:, None]).to(y.dtype))

        self.last_load = counts.detach().float()
        self.last_dropped = (~keep).sum().detach().float()
        return y.view(B, T, D), aux


class Block(nn.Module):
    def __init__(self, dim, heads, moe=None):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.moe = moe
        self.mlp = None if moe is not None else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.moe is not None:
            out, aux = self.moe(self.n2(x))
            return x + out, aux
        return x + self.mlp(self.n2(x)), x.new_zeros(())


class VMoE(nn.Module):
    def __init__(self, a, num_classes=1000, img=224):
        super().__init__()
        self.stem = ConvStem(a.dim)
        n_tok = (img // 16) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, a.dim))
        self.pos = nn.Parameter(torch.randn(1, n_tok + 1, a.dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(a.dim, a.heads, SparseMoE(a.dim, 4 * a.dim, a.experts, a.k, a.capacity) if i % 2 == 1 else None)
            for i in range(a.depth))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, num_classes)

    def forward(self, img):
        x = self.stem(img)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.head(self.norm(x[:, 0])), aux

    def moe_layers(self):
        return [b.moe for b in self.blocks if b.moe is not None]


def build_data(a, rank, world):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.RandAugment(2, 9), transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.ImageFolder(os.path.join(a.data, "train"), train_tf)
    val = datasets.ImageFolder(os.path.join(a.data, "val"), val_tf)
    sampler = DistributedSampler(train, shuffle=True, seed=a.seed, drop_last=True)
    train_loader = DataLoader(train, a.batch_size, sampler=sampler, num_workers=a.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # strided shard without padding so every image is counted exactly once;
    # evaluation runs on the bare module, so ranks may see different batch counts
    val_shard = Subset(val, range(rank, len(val), world))
    val_loader = DataLoader(val_shard, 256, shuffle=False, num_workers=a.workers, pin_memory=True)
    return train_loader, sampler, val_loader


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    for img, target in loader:
        img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = net(img)
        top5 = logits.topk(5, dim=-1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(-1).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")

    torch.manual_seed(a.seed + rank)  # augmentation / dropout streams; weights come from rank 0 via DDP
    net = VMoE(a)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    train_loader, sampler, val_loader = build_data(a, rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    steps_per_epoch = len(train_loader) // a.accum
    total_steps, warm = a.epochs * steps_per_epoch, a.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total_steps - warm))))

    start_epoch, best = 0, 0.0
    if a.resume:
        ck = torch.load(a.resume, map_location="cpu")
        net.load_state_dict({k.removeprefix("module."): v for k, v in ck["model"].items()})
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    if rank == 0:
        os.makedirs(a.output, exist_ok=True)
        if not a.no_wandb:
            wandb.init(project="vmoe", name=os.path.basename(a.output), config=vars(a))

    moe_layers = net.moe_layers()
    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        for it, (img, target) in enumerate(train_loader):
            img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
            boundary = (it + 1) % a.accum == 0
            ctx = model.no_sync() if not boundary else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, aux = model(img)
                    loss = F.cross_entropy(logits, target, label_smoothing=0.1) + a.aux_coef * aux
                (loss / a.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

            if (it + 1) % (50 * a.accum) == 0:
                load = torch.stack([m.last_load for m in moe_layers])          # [layers, experts]
                dropped = torch.stack([m.last_dropped for m in moe_layers]).sum()
                packed = torch.cat([load.flatten(), dropped[None], loss.detach()[None]])
                dist.all_reduce(packed)
                load = packed[:-2].view_as(load)
                frac = load / load.sum(-1, keepdim=True)
                drop_rate = packed[-2] / (load.sum() + packed[-2])
                if rank == 0:
                    msg = {"train/loss": packed[-1].item() / world, "train/drop_rate": drop_rate.item(),
                           "train/max_expert_frac": frac.max().item(), "lr": sched.get_last_lr()[0]}
                    print(f"ep {epoch} it {it + 1}/{len(train_loader)} " +
                          " ".join(f"{k}={v:.4g}" for k, v in msg.items()) + f" {time.time() - t0:.0f}s")
                    if not a.no_wandb:
                        wandb.log(msg)

        top1, top5 = evaluate(net, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}")
            if not a.no_wandb:
                wandb.log({"val/top1": top1, "val/top5": top5, "epoch": epoch})
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, top1)}
            torch.save(state, os.path.join(a.output, "last.pt"))
            if top1 > best:
                torch.save(state, os.path.join(a.output, "best.pt"))
        best = max(best, top1)
        dist.barrier()

    if rank == 0 and not a.no_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
