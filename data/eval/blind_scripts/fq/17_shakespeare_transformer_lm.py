"""
Word-piece-free byte-level Transformer LM on tiny-shakespeare, DDP over local GPUs with mp.spawn.
Features: activation checkpointing, early stopping on validation loss, resumable, samples text.

    python 17_shakespeare_transformer_lm.py --data input.txt --nproc 4
    python 17_shakespeare_transformer_lm.py --data input.txt --nproc 4 --resume lm_ckpt/last.pt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor, ctx: int, stride: int):
        self.data, self.ctx = data, ctx
        self.starts = list(range(0, len(data) - ctx - 1, stride))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.data[s: s + self.ctx + 1].long()
        return x[:-1], x[1:]


class CausalBlock(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.ff(self.ln2(x)))


class ByteLM(nn.Module):
    def __init__(self, ctx=256, d=512, layers=8, heads=8, dropout=0.1, grad_ckpt=False):
        super().__init__()
        self.ctx, self.grad_ckpt = ctx, grad_ckpt
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([CausalBlock(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.out(self.ln(x))

    @torch.no_grad()
    def generate(self, prompt: bytes, n: int, device, temperature=0.9):
        idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
        for _ in range(n):
            logits = self(idx[:, -self.ctx:])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, -1), 1)], 1)
        return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


@torch.no_grad()
def val_loss(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        s[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)

    with open(args.data, "rb") as f:
        raw = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    split = int(0.95 * len(raw))
    train_ds = ByteWindows(raw[:split], args.ctx, stride=args.ctx // 2)
    val_ds = ByteWindows(raw[split:], args.ctx, stride=args.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=2, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = ByteLM(ctx=args.ctx, grad_ckpt=args.grad_ckpt).to(device)
    model = DDP(model, device_ids=[rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    start_epoch, best, bad_epochs = 0, float("inf"), 0
    if args.resume and os.path.exists(args.resume):
        ck = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best, bad_epochs = ck["epoch"] + 1, ck["best"], ck["bad_epochs"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.3f}")

        vl = val_loss(model, val_dl, device)  # all-reduced: identical on every rank
        if vl < best - 1e-3:
            best, bad_epochs = vl, 0
        else:
            bad_epochs += 1

        if rank == 0:
            print(f"epoch {epoch}: val loss {vl:.4f} (best {best:.4f}) {time.time() - t0:.0f}s")
            model.eval()
            print(model.module.generate(b"ROMEO:\n", 200, device))
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": best, "bad_epochs": bad_epochs}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if bad_epochs == 0:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

        # every rank sees the same val loss, so every rank stops at the same epoch
        if bad_epochs >= args.patience:
            if rank == 0:
                print(f"early stopping after epoch {epoch}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="input.txt")
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--port", type=int, default=29600)
    ap.add_argument("--resume", default="")
    ap.add_argument("--out", default="lm_ckpt")
    args = ap.parse_args()
    mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
