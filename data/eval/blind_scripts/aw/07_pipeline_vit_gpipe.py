"""Pipeline-parallel ViT-L/16 training with GPipe micro-batching.

One pipeline stage per GPU. Stage 0 reads the images, runs the patch embedding
and the first blocks, and ships the labels of the batch to the last stage,
which owns the classifier and computes the loss.

    torchrun --nproc_per_node=4 07_pipeline_vit_gpipe.py --data /data/imagenet --chunks 8
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def parse_args():
    parser = argparse.ArgumentParser(description="GPipe ViT")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--out", type=str, default="./pipe_vit_ckpt")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--wd", type=float, default=0.05)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViTStage(nn.Module):
    def __init__(self, args, stage, n_stages):
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        per = args.depth // n_stages
        if self.is_first:
            self.patch = nn.Conv2d(3, args.dim, 16, 16)
            self.cls = nn.Parameter(torch.zeros(1, 1, args.dim))
            self.pos = nn.Parameter(torch.randn(1, 197, args.dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(per)])
        if self.is_last:
            self.norm = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, args.num_classes)

    def forward(self, x):
        if self.is_first:
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        x = self.blocks(x)
        if self.is_last:
            x = self.head(self.norm(x[:, 0]))
        return x


class GPipeRunner:
    def __init__(self, stage, args, rank, world, device):
        self.stage, self.args = stage, args
        self.rank, self.world, self.device = rank, world, device
        self.prev, self.next = rank - 1, rank + 1
        self.mb = args.batch_size // args.chunks
        self.act_shape = (self.mb, 197, args.dim)

    def _exchange_labels(self, y):
        # the last stage needs the labels; only stage 0 reads the data
        if self.rank == 0:
            dist.send(y.to(self.device), dst=self.world - 1)
            return None
        if self.stage.is_last:
            buf = torch.empty(self.args.batch_size, dtype=torch.long, device=self.device)
            dist.recv(buf, src=0)
            return buf
        return None

    def step(self, x, y, train=True):
        labels = self._exchange_labels(y)
        ins, outs, losses, correct = [], [], [], 0
        for m in range(self.args.chunks):
            if self.stage.is_first:
                inp = x[m * self.mb:(m + 1) * self.mb].to(self.device, non_blocking=True)
            else:
                inp = torch.empty(self.act_shape, device=self.device)
                dist.recv(inp, src=self.prev)
                inp.requires_grad_(train)
            out = self.stage(inp)
            if self.stage.is_last:
                tgt = labels[m * self.mb:(m + 1) * self.mb]
                losses.append(F.cross_entropy(out, tgt, label_smoothing=0.1 if train else 0.0) / self.args.chunks)
                correct += (out.argmax(-1) == tgt).sum().item()
            else:
                dist.send(out.detach(), dst=self.next)
            ins.append(inp)
            outs.append(out)
        if train:
            for m in reversed(range(self.args.chunks)):
                if self.stage.is_last:
                    losses[m].backward()
                else:
                    g = torch.empty(self.act_shape, device=self.device)
                    dist.recv(g, src=self.next)
                    outs[m].backward(g)
                if not self.stage.is_first:
                    dist.send(ins[m].grad, dst=self.prev)
        stats = torch.zeros(2, device=self.device)
        if self.stage.is_last:
            stats[0] = sum(l.item() for l in losses)
            stats[1] = correct
        dist.broadcast(stats, src=self.world - 1)
        return stats[0].item(), stats[1].item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    assert args.depth % world == 0 and args.batch_size % args.chunks == 0

    torch.manual_seed(args.seed + rank)
    stage = ViTStage(args, rank, world).to(device)
    runner = GPipeRunner(stage, args, rank, world, device)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=args.wd)

    train_loader = val_loader = None
    n_train = n_val = 0
    if rank == 0:
        norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
        val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
            transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
        train_loader = DataLoader(train_ds, args.batch_size, shuffle=True, num_workers=args.workers,
                                  pin_memory=True, drop_last=True)
        val_loader = DataLoader(val_ds, args.batch_size, shuffle=False, num_workers=args.workers,
                                pin_memory=True, drop_last=True)
        n_train, n_val = len(train_loader), len(val_loader)
    # the other stages only need to know how many steps to run
    counts = torch.tensor([n_train, n_val], device=device)
    dist.broadcast(counts, src=0)
    n_train, n_val = counts.tolist()

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * n_train)
    dummy = torch.empty(0)
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        stage.train()
        it = iter(train_loader) if rank == 0 else None
        t0 = time.time()
        for i in range(n_train):
            x, y = next(it) if rank == 0 else (dummy, dummy)
            optimizer.zero_grad(set_to_none=True)
            loss, correct = runner.step(x, y, train=True)
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} [{i}/{n_train}] loss {loss:.4f} "
                      f"acc {100 * correct / args.batch_size:.1f}% {time.time() - t0:.0f}s", flush=True)

        stage.eval()
        hits = 0.0
        it = iter(val_loader) if rank == 0 else None
        with torch.no_grad():
            for _ in range(n_val):
                x, y = next(it) if rank == 0 else (dummy, dummy)
                hits += runner.step(x, y, train=False)[1]
        if rank == 0:
            print(f"epoch {epoch} val top1 {100 * hits / (n_val * args.batch_size):.2f}%", flush=True)

        torch.save({"stage": stage.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "world": world}, os.path.join(args.out, f"stage{rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
