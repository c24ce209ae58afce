"""V-MoE style image classifier: a ViT whose every other MLP is a mixture of experts.

All experts are replicated on every GPU (no expert parallelism yet); plain data
parallelism with DDP over the whole model.

    torchrun --nproc_per_node=8 04_vmoe_image_classifier.py --data /datasets/imagenet --epochs 90
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
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output", default="output/vmoe_s16")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.05)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class MoEMLP(nn.Module):
    def __init__(self, dim, hidden, num_experts, capacity_factor):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(num_experts)])
        self.aux_loss = torch.zeros(())

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.size(0)
        probs = self.router(x).float().softmax(-1)
        weight, expert_idx = probs.max(-1)

        frac_tokens = torch.bincount(expert_idx, minlength=self.num_experts).float() / n
        self.aux_loss = self.num_experts * (frac_tokens * probs.mean(0)).sum()

        capacity = math.ceil(self.capacity_factor * n / self.num_experts)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (expert_idx == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            idx = idx[:capacity]
            out[idx] = expert(x[idx]) * weight[idx, None].to(x.dtype)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, dim, heads, moe, args):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        if moe:
            self.mlp = MoEMLP(dim, 4 * dim, args.num_experts, args.capacity_factor)
        else:
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VMoE(nn.Module):
    def __init__(self, args):
        super().__init__()
        n_patches = (args.img_size // args.patch) ** 2
        self.patch_embed = nn.Conv2d(3, args.dim, args.patch, args.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, args.dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, args.dim) * 0.02)
        self.blocks = nn.ModuleList([Block(args.dim, args.heads, moe=(i % 2 == 1), args=args)
                                     for i in range(args.depth)])
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.num_classes)

    def forward(self, img):
        x = self.patch_embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


def moe_aux_loss(model):
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEMLP)]
    return sum(losses) / len(losses)


def build_loaders(args):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.img_size),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(int(args.img_size / 0.875)),
                                 transforms.CenterCrop(args.img_size), transforms.ToTensor(), normalize])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for img, target in loader:
        img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(img)
        stats[0] += F.cross_entropy(logits.float(), target, reduction="sum")
        stats[1] += (logits.argmax(-1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank()

    train_loader, val_loader, train_sampler = build_loaders(args)
    model = VMoE(args).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    steps_per_epoch = len(train_loader)
    total, warmup = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    scaler = torch.cuda.amp.GradScaler()
    best_acc = 0.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (img, target) in enumerate(train_loader):
            img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = F.cross_entropy(logits, target, label_smoothing=0.1)
                aux = moe_aux_loss(model)
                total_loss = loss + args.aux_weight * aux
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(total_loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.3f} aux {aux.item():.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        val_loss, val_acc = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s  val_loss {val_loss:.3f}  top1 {val_acc:.2f}", flush=True)
            os.makedirs(args.output, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.output, "last.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(ckpt, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
