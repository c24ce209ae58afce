"""ViT-H/14 on ImageNet-21k with 2D parallelism: hand-written tensor-parallel
attention / MLP over the "tp" dimension of a DeviceMesh, DDP over "dp".

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=gpu-a01:29500 \
        14_tp_vit_huge.py --data /nfs/imagenet21k --tp 4 --output-dir /nfs/exp/vith14_tp4
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=1280)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--num-classes", type=int, default=21843)
    p.add_argument("--batch-size", type=int, default=64, help="per data-parallel replica")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.03)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


class _F(torch.autograd.Function):
    """identity forward, all-reduce backward"""
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.g)
        return grad, None


class _G(torch.autograd.Function):
    """all-reduce forward, identity backward"""
    @staticmethod
    def forward(ctx, x, g):
        x = x.contiguous()
        dist.all_reduce(x, group=g)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPAttention(nn.Module):
    def __init__(self, dim, heads, tp_group):
        super().__init__()
        self.g = tp_group
        tp = dist.get_world_size(tp_group)
        self.local_heads = heads // tp
        self.hd = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim // tp)
        self.proj = nn.Linear(dim // tp, dim, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(_F.apply(x, self.g)).view(B, N, 3, self.local_heads, self.hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return _G.apply(self.proj(o.transpose(1, 2).reshape(B, N, -1)), self.g) + self.proj_bias


class TPMlp(nn.Module):
    def __init__(self, dim, hidden, tp_group):
        super().__init__()
        self.g = tp_group
        tp = dist.get_world_size(tp_group)
        self.fc1 = nn.Linear(dim, hidden // tp)
        self.fc2 = nn.Linear(hidden // tp, dim, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return _G.apply(self.fc2(F.gelu(self.fc1(_F.apply(x, self.g)))), self.g) + self.fc2_bias


class Block(nn.Module):
    def __init__(self, dim, heads, tp_group):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = TPAttention(dim, heads, tp_group)
        self.mlp = TPMlp(dim, 4 * dim, tp_group)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TPViT(nn.Module):
    def __init__(self, a, tp_group):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, a.embed_dim, 14, 14)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, a.embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 257, a.embed_dim) * 0.02)
        self.blocks = nn.ModuleList([Block(a.embed_dim, a.heads, tp_group) for _ in range(a.depth)])
        self.norm = nn.LayerNorm(a.embed_dim, eps=1e-6)
        self.head = nn.Linear(a.embed_dim, a.num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], 1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    tp_rank, dp_rank, dp_size = mesh.get_local_rank("tp"), mesh.get_local_rank("dp"), mesh.size(0)
    device = torch.device("cuda", local_rank)

    # replicated params must match across TP ranks; TP shards must differ
    torch.manual_seed(0)
    model = TPViT(args, tp_group)
    g = torch.Generator().manual_seed(100 + tp_rank)
    for n, p in model.named_parameters():
        if any(n.endswith(s) for s in ("qkv.weight", "qkv.bias", "proj.weight", "fc1.weight", "fc1.bias", "fc2.weight")):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.zeros(p.shape))
    model = DDP(model.to(device), device_ids=[local_rank], process_group=dp_group)

    norm = transforms.Normalize([0.5] * 3, [0.5] * 3)
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    # TP peers share a dp index and therefore get the same images
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))
    steps_per_epoch = len(train_dl)
    warm, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        assert ckpt["tp_size"] == args.tp
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (img, target) in enumerate(train_dl):
            img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(img), target, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for img, target in val_dl:
                img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(img)
                top5 = out.topk(5, -1).indices
                stats[0] += (top5[:, 0] == target).sum()
                stats[1] += (top5 == target[:, None]).any(-1).sum()
                stats[2] += target.numel()
        dist.all_reduce(stats, group=dp_group)
        if rank == 0:
            print(f"epoch {epoch} top1 {100 * stats[0] / stats[2]:.2f} top5 {100 * stats[1] / stats[2]:.2f}", flush=True)

        if dp_rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "tp_size": args.tp},
                       os.path.join(args.output_dir, f"checkpoint_{epoch:04d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
