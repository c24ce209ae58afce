"""ViT-H/14 on ImageNet with Megatron-style tensor parallelism (TP) x data parallelism (DP).

Only tensor-parallel rank 0 of each TP group runs the input pipeline; the batch is
broadcast to the other ranks of the group, so all TP peers see the same pixels.

    torchrun --nproc_per_node=8 07_tp_vit_imagenet.py --tp 4 --data /datasets/imagenet --output-dir out/vit_h_tp4
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

TP = {"group": None, "rank": 0, "size": 1, "src": 0}
DP = {"group": None, "rank": 0, "size": 1}


def setup_groups(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    for i in range(world // tp):
        ranks = list(range(i * tp, (i + 1) * tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            TP.update(group=g, rank=rank - ranks[0], size=tp, src=ranks[0])
    for j in range(tp):
        ranks = list(range(j, world, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            DP.update(group=g, rank=ranks.index(rank), size=len(ranks))


class _Fwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=TP["group"])
        return g


class _Red(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=TP["group"])
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class ColumnParallelLinear(nn.Linear):
    def __init__(self, fin, fout):
        super().__init__(fin, fout // TP["size"])
        full = torch.empty(fout, fin)
        nn.init.trunc_normal_(full, std=0.02)
        self.weight.data.copy_(full.chunk(TP["size"], 0)[TP["rank"]])
        nn.init.zeros_(self.bias)

    def forward(self, x):
        return super().forward(_Fwd.apply(x))


class RowParallelLinear(nn.Linear):
    def __init__(self, fin, fout):
        super().__init__(fin // TP["size"], fout)
        full = torch.empty(fout, fin)
        nn.init.trunc_normal_(full, std=0.02)
        self.weight.data.copy_(full.chunk(TP["size"], 1)[TP["rank"]])
        nn.init.zeros_(self.bias)

    def forward(self, x):
        return _Red.apply(F.linear(x, self.weight)) + self.bias


class ParallelMHA(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.hd = heads // TP["size"], dim // heads
        self.qkv = ColumnParallelLinear(dim, 3 * dim)
        self.proj = RowParallelLinear(dim, dim)

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, self.h, 3, self.hd).permute(3, 0, 2, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(B, N, -1))


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = ParallelMHA(dim, heads)
        self.fc1 = ColumnParallelLinear(dim, mlp_ratio * dim)
        self.fc2 = RowParallelLinear(mlp_ratio * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, img=224, patch=14, dim=1280, depth=32, heads=16, n_cls=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        n = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, n_cls)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def tp_broadcast_batch(loader_iter, shape):
    n = torch.zeros(1, dtype=torch.long, device="cuda")
    if TP["rank"] == 0:
        img, lbl = next(loader_iter)
        img, lbl = img.cuda(non_blocking=True), lbl.cuda(non_blocking=True)
        n[0] = lbl.numel()
    dist.broadcast(n, src=TP["src"], group=TP["group"])
    if TP["rank"] != 0:
        img = torch.empty(int(n), *shape, device="cuda")
        lbl = torch.empty(int(n), dtype=torch.long, device="cuda")
    dist.broadcast(img, src=TP["src"], group=TP["group"])
    dist.broadcast(lbl, src=TP["src"], group=TP["group"])
    return img, lbl


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--output-dir", default="out/vit_tp")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="per data-parallel replica")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    setup_groups(args.tp)
    torch.manual_seed(0)
    is_master = dist.get_rank() == 0

    model = ViT().cuda()
    model = DDP(model, device_ids=[local_rank], process_group=DP["group"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1

    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=DP["size"], rank=DP["rank"], shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=DP["size"], rank=DP["rank"], shuffle=False, drop_last=True)
    nw = args.workers if TP["rank"] == 0 else 0
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=nw,
                              pin_memory=True, drop_last=True, persistent_workers=nw > 0)
    val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, num_workers=nw)
    steps, val_steps = len(train_loader), len(val_loader)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        it = iter(train_loader) if TP["rank"] == 0 else None
        t0 = time.time()
        for step in range(steps):
            img, lbl = tp_broadcast_batch(it, (3, 224, 224))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(img), lbl, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=DP["group"])
                if is_master:
                    print(f"epoch {epoch} [{step}/{steps}] loss {l.item():.4f} "
                          f"{(time.time() - t0) / (step + 1):.3f}s/it", flush=True)
        sched.step()

        model.eval()
        correct = torch.zeros(2, device="cuda")
        it = iter(val_loader) if TP["rank"] == 0 else None
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(val_steps):
                img, lbl = tp_broadcast_batch(it, (3, 224, 224))
                correct[0] += (model(img).argmax(1) == lbl).sum()
                correct[1] += lbl.numel()
        dist.all_reduce(correct, group=DP["group"])
        if is_master:
            print(f"epoch {epoch} top1 {100 * correct[0].item() / correct[1].item():.2f}", flush=True)

        if DP["rank"] == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "lr_scheduler": sched.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, os.path.join(args.output_dir, f"checkpoint_{epoch:03d}.pth"))
            torch.save(state, os.path.join(args.output_dir, "checkpoint_last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
