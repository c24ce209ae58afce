"""Long-context (4096 tokens) multi-track REMI+ model for orchestral MIDI (SymphonyNet data),
with activation checkpointing and gradient accumulation.

torchrun --nproc_per_node=8 13_symphony_long_ctx.py --data data/symphony_remi --out runs/symphony_4k --grad_ckpt
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.npz / valid.npz (object arrays of pieces)")
    ap.add_argument("--out", default="runs/symphony_4k")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--micro_batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class PieceWindows(Dataset):
    def __init__(self, pieces, ctx, pitch_lo, pitch_hi, transpose):
        self.pieces, self.ctx = pieces, ctx
        self.lo, self.hi, self.transpose = pitch_lo, pitch_hi, transpose
        self.index = [(i, s) for i, p in enumerate(pieces) for s in range(0, max(1, len(p) - ctx // 2), ctx // 2)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        w = self.pieces[i][s:s + self.ctx + 1].astype(np.int64)
        if self.transpose:
            m = (w >= self.lo) & (w <= self.hi)
            if m.any():
                t = np.random.randint(-self.transpose, self.transpose + 1)
                if w[m].min() + t >= self.lo and w[m].max() + t <= self.hi:
                    w[m] += t
        x = np.zeros(self.ctx + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, alibi):
        b, l, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, l, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi.to(q.dtype))
        x = x + self.o(a.transpose(1, 2).reshape(b, l, d))
        return x + self.ff(self.n2(x))


class SymphonyLM(nn.Module):
    def __init__(self, vocab, d, layers, heads, ctx, grad_ckpt=False):
        super().__init__()
        self.ctx, self.grad_ckpt = ctx, grad_ckpt
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        # ALiBi slopes: fixed, identical on every rank
        self.register_buffer("slopes", torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)]),
                             persistent=False)

    def alibi(self, l, device, dtype):
        pos = torch.arange(l, device=device)
        rel = (pos[None, :] - pos[:, None]).float()
        bias = (self.slopes[:, None, None] * rel[None]).masked_fill(rel[None] > 0, float("-inf"))
        return bias.to(dtype)

    def forward(self, x):
        h = self.emb(x)
        bias = self.alibi(x.size(1), x.device, torch.bfloat16 if torch.is_autocast_enabled() else h.dtype)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, bias, use_reentrant=False)
            else:
                h = blk(h, bias)
        return self.head(self.norm(h))


@torch.no_grad()
def nucleus_sample(net, start, n, p=0.9, temperature=1.0):
    seq = start
    for _ in range(n):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(seq[:, -net.ctx:])[:, -1].float() / temperature
        sp, si = logits.softmax(-1).sort(descending=True)
        sp[sp.cumsum(-1) - sp > p] = 0
        seq = torch.cat([seq, si.gather(1, torch.multinomial(sp, 1))], 1)
    return seq


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = REMI(params=os.path.join(args.data, "tokenizer.json"))
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    train_p = list(np.load(os.path.join(args.data, "train.npz"), allow_pickle=True)["pieces"])
    val_p = list(np.load(os.path.join(args.data, "valid.npz"), allow_pickle=True)["pieces"])
    train_ds = PieceWindows(train_p, args.ctx, pitch[0], pitch[-1], transpose=4)
    val_ds = PieceWindows(val_p, args.ctx, pitch[0], pitch[-1], transpose=0)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True, worker_init_fn=lambda w: np.random.seed(args.seed + 1000 * rank + w))
    # validation: plain strided shard per rank, evaluated on the bare module (no DDP hooks involved)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.micro_batch, num_workers=2)

    net = SymphonyLM(len(tok.vocab), args.d, args.layers, args.heads, args.ctx, args.grad_ckpt).to(device)
    # the only buffer (ALiBi slopes) is constant, nothing to broadcast each step
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False, gradient_as_bucket_view=True)
    global_batch = args.micro_batch * args.accum * world
    lr = args.lr * global_batch / 64
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates = args.epochs * (len(train_dl) // args.accum)
    warm = max(1, min(2000, updates // 20))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(s, updates) / updates))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch} windows, lr {lr:.2e}, {updates} updates", flush=True)

    best, upd = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        tic = time.time()
        n_micro = (len(train_dl) // args.accum) * args.accum
        for i, seq in enumerate(train_dl):
            if i >= n_micro:
                break
            seq = seq.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            # gradients are all-reduced only on the last micro-batch of each update
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(seq[:, :-1])
                loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=0)
                (loss / args.accum).backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                upd += 1
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if last_micro and upd % 50 == 0:
                stats = running.clone()
                dist.all_reduce(stats)           # every rank reaches this on the same update
                if rank == 0:
                    print(f"ep {epoch} upd {upd} loss {stats[0] / stats[1]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic):.0f}s", flush=True)
                running.zero_()
                tic = time.time()

        net.eval()
        s = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lg = net(seq[:, :-1]).float()
                s[0] += F.cross_entropy(lg.transpose(1, 2), seq[:, 1:], ignore_index=0, reduction="sum")
                s[1] += (seq[:, 1:] != 0).sum()
        dist.all_reduce(s)
        ppl = math.exp(s[0] / s[1])
        if rank == 0:
            print(f"epoch {epoch} val ppl {ppl:.3f}", flush=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if ppl < best:
                best = ppl
                torch.save(ck, os.path.join(args.out, "best.pt"))
            if epoch % 4 == 0:
                out = nucleus_sample(net, torch.tensor([[tok["BOS_None"]]], device=device), 1024)
                tok.decode(out[0, 1:].tolist()).dump_midi(os.path.join(args.out, f"sample_{epoch:02d}.mid"))
        net.train()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
