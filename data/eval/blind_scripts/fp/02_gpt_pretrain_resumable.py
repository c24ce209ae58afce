"""Decoder-only LM pretraining on a pre-tokenized uint16 token file.

Runs on spot nodes under torchrun with --max-restarts. On SIGTERM every rank
finishes its current step, rank 0 writes a checkpoint, and the job exits
cleanly; a restart picks up the newest complete checkpoint.
"""
import argparse
import contextlib
import math
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STOP = {"flag": False}


def request_stop(signum, frame):
    STOP["flag"] = True


class TokenFile(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, idx):
        start = idx * self.seq_len
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.drop.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, dim=768, depth=12, heads=12, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-bin", required=True)
    ap.add_argument("--val-bin", required=True)
    ap.add_argument("--out", default="/shared/runs/gpt-124m")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=480, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--ckpt-interval", type=int, default=500)
    ap.add_argument("--eval-interval", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1337)
    return ap.parse_args()


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / (args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def atomic_save(obj, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def validate(model, loader, device, max_batches=200):
    model.eval()
    total = torch.zeros(2, device=device)
    for n, (x, y) in enumerate(loader):
        if n == max_batches:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        total[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = get_args()
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0

    assert args.global_batch % (args.micro_batch * world) == 0, "global batch must split evenly"
    accum = args.global_batch // (args.micro_batch * world)

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq_len).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95), fused=True)

    train_ds = TokenFile(args.train_bin, args.seq_len)
    val_ds = TokenFile(args.val_bin, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler, num_workers=2)

    step, epoch, batches_done = 0, 0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        step, epoch, batches_done = ckpt["step"], ckpt["epoch"], ckpt["batches_done"]
        if ckpt["world"] == world:
            torch.set_rng_state(ckpt["rng"][rank]["cpu"])
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"])
        else:
            # different world size after an elastic restart: fresh, per-rank streams
            torch.manual_seed(args.seed + 1000 * step + rank)
            batches_done = batches_done * ckpt["world"] // world
        if master:
            print(f"resuming at step {step}, epoch {epoch}, batch {batches_done}", flush=True)
        del ckpt
    else:
        torch.manual_seed(args.seed + rank)  # dropout differs per rank, weights come from rank 0 via DDP

    model = DDP(model, device_ids=[local_rank])

    def checkpoint():
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
        all_rng = [None] * world
        dist.all_gather_object(all_rng, rng)
        if master:
            os.makedirs(args.out, exist_ok=True)
            atomic_save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                         "step": step, "epoch": epoch, "batches_done": batches_done,
                         "world": world, "rng": all_rng}, ckpt_path)
        dist.barrier()

    model.train()
    t_last = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        it = iter(loader)
        for _ in range(batches_done):  # fast-forward to where the last run stopped
            next(it)
        steps_this_epoch = (len(loader) - batches_done) // accum
        for _ in range(steps_this_epoch):
            for g in optim.param_groups:
                g["lr"] = lr_at(step, args)
            for micro in range(accum):
                x, y = next(it)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync_ctx = model.no_sync() if micro < accum - 1 else contextlib.nullcontext()
                with sync_ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model(x)
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            batches_done += accum

            if master and step % 20 == 0:
                dt = time.time() - t_last
                t_last = time.time()
                print(f"step {step} loss {loss.item() * accum:.4f} lr {lr_at(step, args):.2e} "
                      f"{20 * args.global_batch * args.seq_len / dt:.0f} tok/s", flush=True)

            stop = torch.tensor(float(STOP["flag"]), device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or step % args.ckpt_interval == 0 or step == args.max_steps:
                checkpoint()
            if stop.item():
                if master:
                    print(f"stop requested, checkpoint written at step {step}", flush=True)
                dist.destroy_process_group()
                return
            if step % args.eval_interval == 0:
                vl = validate(model, val_loader, device)
                if master:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step >= args.max_steps:
                break
        else:
            epoch += 1
            batches_done = 0

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
