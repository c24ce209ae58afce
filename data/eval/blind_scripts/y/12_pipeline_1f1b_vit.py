"""ViT-L/16 split over GPUs as a pipeline, 1F1B schedule (PipeDream-flush),
activations and gradients exchanged with batch_isend_irecv.

The first and last stage both read the same shuffled stream (same seed), so
the last stage has the labels without sending them around.

    torchrun --nproc_per_node=4 pipe_vit.py --data /data/imagenet --micro-batches 16
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, RandomSampler
from torchvision import transforms as T

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViTStage(nn.Module):
    def __init__(self, stage, n_stages, depth=24, dim=1024, heads=16, num_classes=1000, img=224, patch=16):
        super().__init__()
        self.first, self.last = stage == 0, stage == n_stages - 1
        per = depth // n_stages
        if self.first:
            self.patch = nn.Conv2d(3, dim, patch, patch)
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads) for _ in range(per)])
        if self.last:
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        if self.first:
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        x = self.blocks(x)
        if self.last:
            x = self.head(self.norm(x[:, 0]))
        return x


class P2P:
    def __init__(self, rank, n_stages, shape):
        self.rank, self.n, self.shape = rank, n_stages, shape

    def _run(self, send_next=None, recv_prev=False, send_prev=None, recv_next=False):
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.rank + 1))
        if recv_prev:
            from_prev = torch.empty(self.shape, device=DEVICE, requires_grad=True)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.rank - 1))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.rank - 1))
        if recv_next:
            from_next = torch.empty(self.shape, device=DEVICE)
            ops.append(dist.P2POp(dist.irecv, from_next, self.rank + 1))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return from_prev, from_next

    def recv_forward(self):
        return None if self.rank == 0 else self._run(recv_prev=True)[0]

    def send_forward(self, y):
        if self.rank < self.n - 1:
            self._run(send_next=y.detach())

    def recv_backward(self):
        return None if self.rank == self.n - 1 else self._run(recv_next=True)[1]

    def send_backward(self, g):
        if self.rank > 0:
            self._run(send_prev=g)

    def send_forward_recv_backward(self, y):
        if self.rank == self.n - 1:
            return None
        return self._run(send_next=y.detach(), recv_next=True)[1]

    def send_backward_recv_forward(self, g):
        if self.rank == 0:
            return None
        return self._run(send_prev=g, recv_prev=True)[0]


def train_step(stage, p2p, images, labels, args, rank, n_stages):
    M = args.micro_batches
    img_mb = images.chunk(M) if images is not None else [None] * M
    lab_mb = labels.chunk(M) if labels is not None else [None] * M
    fwd_i = 0
    losses = []

    def forward(x):
        nonlocal fwd_i
        if rank == 0:
            x = img_mb[fwd_i].to(DEVICE, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage(x)
        if rank == n_stages - 1:
            out = F.cross_entropy(out.float(), lab_mb[fwd_i].to(DEVICE), label_smoothing=0.1) / M
            losses.append(out.detach())
        else:
            out = out.float()
        fwd_i += 1
        return x, out

    def backward(x, y, grad):
        if grad is None:
            y.backward()
        else:
            y.backward(grad)
        return None if rank == 0 else x.grad

    warmup = min(n_stages - rank - 1, M)
    remaining = M - warmup
    inputs, outputs = [], []

    for _ in range(warmup):
        x, y = forward(p2p.recv_forward())
        p2p.send_forward(y)
        inputs.append(x)
        outputs.append(y)

    x_in = p2p.recv_forward() if remaining > 0 else None
    for i in range(remaining):
        x, y = forward(x_in)
        grad_out = p2p.send_forward_recv_backward(y)
        inputs.append(x)
        outputs.append(y)
        g_in = backward(inputs.pop(0), outputs.pop(0), grad_out)
        if i == remaining - 1:
            p2p.send_backward(g_in)
        else:
            x_in = p2p.send_backward_recv_forward(g_in)

    for _ in range(warmup):
        grad_out = p2p.recv_backward()
        g_in = backward(inputs.pop(0), outputs.pop(0), grad_out)
        p2p.send_backward(g_in)

    return torch.stack(losses).sum() if losses else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-size", type=int, default=256, help="per pipeline step")
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="ckpt/pipe_vit_l16")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, n_stages = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == n_stages - 1
    torch.manual_seed(args.seed + rank)

    stage = ViTStage(rank, n_stages).to(DEVICE)
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.05)
    mb = args.batch_size // args.micro_batches
    p2p = P2P(rank, n_stages, (mb, 197, 1024))

    loader = None
    if first or last:
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), tf)
        gen = torch.Generator()
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=RandomSampler(ds, generator=gen),
                            num_workers=8 if first else 2, drop_last=True, pin_memory=True)
        steps_per_epoch = torch.tensor([len(loader)], device=DEVICE)
    else:
        steps_per_epoch = torch.zeros(1, dtype=torch.long, device=DEVICE)
    dist.broadcast(steps_per_epoch, src=0)
    steps_per_epoch = int(steps_per_epoch.item())
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5000) * 0.5 * (1 + math.cos(math.pi * s / total)))

    os.makedirs(args.ckpt_dir, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        if loader is not None:
            gen.manual_seed(args.seed * 1000 + epoch)  # identical order on first and last stage
            it = iter(loader)
        t0 = time.time()
        for _ in range(steps_per_epoch):
            images = labels = None
            if loader is not None:
                images, labels = next(it)
                if last and not first:
                    images = None  # the last stage only needs the labels
            opt.zero_grad(set_to_none=True)
            loss = train_step(stage, p2p, images, labels, args, rank, n_stages)
            torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if last and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()

        torch.save({"stage": rank, "n_stages": n_stages, "model": stage.state_dict(),
                    "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch},
                   os.path.join(args.ckpt_dir, f"stage{rank:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
