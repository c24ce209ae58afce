"""Train a 350M decoder LM on variable-length documents: DDP + torch.compile + length buckets.

Documents are not packed. Each batch is right-padded to the next bucket
length, and the sequence dimension is marked dynamic so Dynamo builds one
symbolic graph for all buckets instead of recompiling for every length.
The model is compiled *after* DDP wrapping so DDPOptimizer can split the
graph at bucket boundaries and overlap the all-reduce with backward.

    torchrun --nproc_per_node=8 lm_ddp_dynamic_buckets.py --data /shared/tok/pile_docs --out /shared/ckpt/lm350m
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BUCKETS = (128, 256, 512, 1024, 2048)
PAD_ID = 0


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        # right padding + causal mask: real tokens never attend to the pad tail
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class LM(nn.Module):
    def __init__(self, vocab=50304, d=1024, n_layer=24, n_head=16, max_len=BUCKETS[-1]):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class Documents(Dataset):
    def __init__(self, root, split, max_len):
        self.tokens = np.memmap(os.path.join(root, f"{split}.bin"), dtype=np.uint16, mode="r")
        self.offsets = np.load(os.path.join(root, f"{split}_offsets.npy"))
        self.max_len = max_len

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        e = min(e, s + self.max_len + 1)
        return torch.from_numpy(self.tokens[s:e].astype(np.int64))


def collate_to_bucket(batch, buckets):
    need = max(len(x) - 1 for x in batch)
    L = next(b for b in buckets if b >= need)
    inp = torch.full((len(batch), L), PAD_ID, dtype=torch.long)
    tgt = torch.full((len(batch), L), -100, dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x) - 1
        inp[i, :n] = x[:-1]
        tgt[i, :n] = x[1:]
    return inp, tgt


def lm_loss(logits, tgt, reduction="mean"):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1), ignore_index=-100,
                           reduction=reduction)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for inp, tgt in loader:
        inp, tgt = inp.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        torch._dynamo.mark_dynamic(inp, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp)
        tot[0] += lm_loss(logits, tgt, reduction="sum")
        tot[1] += (tgt != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global-batch", type=int, default=256, help="documents per optimizer step, all ranks")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak lr for --global-batch")
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0
    per_rank_batch = args.global_batch // world
    torch.manual_seed(0)

    collate = functools.partial(collate_to_bucket, buckets=BUCKETS)
    train_ds = Documents(args.data, "train", BUCKETS[-1])
    val_ds = Documents(args.data, "val", BUCKETS[-1])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=per_rank_batch, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=per_rank_batch, sampler=val_sampler, collate_fn=collate, num_workers=2)

    raw_model = LM().to(device)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))),
    )

    start_epoch, step = 0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        del ckpt

    torch._dynamo.config.optimize_ddp = True
    torch._dynamo.config.cache_size_limit = 16
    model = torch.compile(DDP(raw_model, device_ids=[local_rank]))

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0, toks = time.time(), 0
        for inp, tgt in train_dl:
            inp, tgt = inp.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            torch._dynamo.mark_dynamic(inp, 1)
            torch._dynamo.mark_dynamic(tgt, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = lm_loss(logits, tgt)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            toks += int((tgt != -100).sum())

            if step % 50 == 0:
                stats = torch.tensor([loss.item(), toks], device=device, dtype=torch.float64)
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {stats[0].item() / world:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {stats[1].item() / (time.time() - t0):,.0f} tok/s",
                          flush=True)
                t0, toks = time.time(), 0

            if step % args.eval_every == 0:
                val = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
