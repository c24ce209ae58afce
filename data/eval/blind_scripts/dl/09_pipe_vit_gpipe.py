"""ViT-L/16 trained with a hand-written GPipe schedule, one pipeline stage per GPU.

    torchrun --nproc_per_node=4 09_pipe_vit_gpipe.py --data /data/imagenet100 --chunks 8
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch=16, img=224):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (img // patch) ** 2 + 1, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos


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


class Head(nn.Module):
    def __init__(self, dim, n_cls):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, n_cls)

    def forward(self, x):
        return self.fc(self.norm(x[:, 0]))


def make_stage(rank, world, dim, depth, heads, n_cls):
    # blocks are spread evenly; the first stage also owns the patch embedding,
    # the last one the classifier head
    bounds = [round(i * depth / world) for i in range(world + 1)]
    mods = [PatchEmbed(dim)] if rank == 0 else []
    mods += [Block(dim, heads) for _ in range(bounds[rank], bounds[rank + 1])]
    if rank == world - 1:
        mods.append(Head(dim, n_cls))
    return nn.Sequential(*mods)


class GPipe:
    def __init__(self, stage, rank, world, chunks, micro_bs, act_shape):
        self.stage, self.rank, self.world = stage, rank, world
        self.first, self.last = rank == 0, rank == world - 1
        self.chunks, self.micro_bs, self.act_shape = chunks, micro_bs, act_shape

    def _recv(self, src):
        buf = torch.empty(self.micro_bs, *self.act_shape, device="cuda")
        dist.recv(buf, src)
        return buf

    def step(self, imgs, labels, train=True):
        """Run all micro-batches forward, then all backward. Returns summed loss / correct on the last stage."""
        img_mb = imgs.chunk(self.chunks) if self.first else [None] * self.chunks
        lbl_mb = labels.chunk(self.chunks) if self.last else [None] * self.chunks
        saved, loss_sum, correct = [], 0.0, 0
        for x, y in zip(img_mb, lbl_mb):
            if self.first:
                x = x.cuda(non_blocking=True)
            else:
                x = self._recv(self.rank - 1).requires_grad_(train)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = self.stage(x)
            if self.last:
                y = y.cuda(non_blocking=True)
                loss = F.cross_entropy(out.float(), y) / self.chunks
                loss_sum += loss.item()
                correct += (out.argmax(1) == y).sum().item()
                saved.append((x, loss))
            else:
                out = out.float()
                dist.send(out.detach(), self.rank + 1)
                saved.append((x, out))
        if train:
            for x, out in saved:
                if self.last:
                    out.backward()
                else:
                    grad = self._recv(self.rank + 1)
                    out.backward(grad)
                if not self.first:
                    dist.send(x.grad, self.rank - 1)
        return loss_sum, correct


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/imagenet100")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--ckpt", default="ckpt/vit_gpipe")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)

    stage = make_stage(rank, world, args.dim, args.depth, args.heads, args.classes).cuda()
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.05)
    n_tok = (224 // 16) ** 2 + 1
    pipe = GPipe(stage, rank, world, args.chunks, args.batch // args.chunks, (n_tok, args.dim))

    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    # same generator seed on every stage -> identical batch order down the pipe
    g = torch.Generator().manual_seed(args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch, shuffle=True, generator=g, num_workers=8, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, shuffle=False, num_workers=8, drop_last=True)

    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    warm = args.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    start = 0
    path = os.path.join(args.ckpt, f"stage{rank}.pt")
    if os.path.exists(path):
        sd = torch.load(path, map_location="cuda")
        stage.load_state_dict(sd["stage"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        start = sd["epoch"] + 1

    for epoch in range(start, args.epochs):
        stage.train()
        t0, run_loss = time.time(), 0.0
        for i, (imgs, labels) in enumerate(train_dl):
            opt.zero_grad(set_to_none=True)
            loss, _ = pipe.step(imgs, labels, train=True)
            opt.step()
            sched.step()
            run_loss += loss
            if pipe.last and (i + 1) % 50 == 0:
                print(f"epoch {epoch} it {i + 1}/{steps_per_epoch} loss {run_loss / 50:.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                run_loss, t0 = 0.0, time.time()

        stage.eval()
        correct = seen = 0
        with torch.no_grad():
            for imgs, labels in val_dl:
                _, c = pipe.step(imgs, labels, train=False)
                correct += c
                seen += len(labels)
        if pipe.last:
            print(f"epoch {epoch} val acc {100.0 * correct / seen:.2f}%", flush=True)

        os.makedirs(args.ckpt, exist_ok=True)
        torch.save({"stage": stage.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch}, path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
