"""
Continued pretraining of a Mamba LM on a domain corpus (several epochs).

The corpus is tokenized and packed offline into fixed-length rows (documents joined
with EOS) stored as one int32 array of shape [n_rows, seq_len + 1].

    torchrun --nproc_per_node=4 02_mamba_packed_finetune.py \
        --packed /data/code_corpus/packed_8k.npy --init state-spaces/mamba-790m
"""
import argparse
import contextlib
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from mamba_ssm.models.config_mamba import MambaConfig
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--packed", required=True)
    ap.add_argument("--val_frac", type=float, default=0.01)
    ap.add_argument("--init", default="state-spaces/mamba-790m")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup_ratio", type=float, default=0.02)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--out", default="checkpoints/mamba_domain")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class PackedRows(Dataset):
    def __init__(self, arr, rows):
        self.arr = arr
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = torch.from_numpy(self.arr[self.rows[i]].astype(np.int64))
        return row[:-1], row[1:]


def build_datasets(path, val_frac):
    arr = np.load(path, mmap_mode="r")
    n = arr.shape[0]
    n_val = max(1, int(n * val_frac))
    # rows were shuffled when packing, so a tail split is a random split
    train_rows = np.arange(0, n - n_val)
    val_rows = np.arange(n - n_val, n)
    return PackedRows(arr, train_rows), PackedRows(arr, val_rows)


def cosine_with_warmup(opt, warmup, total):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(prog, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    master = rank == 0

    train_ds, val_ds = build_datasets(args.packed, args.val_frac)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank,
                                     shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler, num_workers=2)

    model = MambaLMHeadModel.from_pretrained(args.init, device=device, dtype=torch.float32)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embedding" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    steps_per_epoch = len(train_dl) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    sched = cosine_with_warmup(opt, int(args.warmup_ratio * total_steps), total_steps)

    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    if master:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"{len(train_ds)} train rows, {steps_per_epoch} optimizer steps/epoch, world {world_size}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros((), device=device)
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.grad_accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss / args.grad_accum).backward()
            running += loss.detach() / args.grad_accum
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if master:
                    elapsed = time.time() - t0
                    toks = args.log_every * args.grad_accum * args.micro_bs * x.size(1) * world_size
                    print(f"ep {epoch} step {step}/{total_steps} loss {running.item() / args.log_every:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {toks / elapsed / 1e3:.1f}k tok/s")
                    t0 = time.time()
                running.zero_()

        val_loss = evaluate(model, val_dl, device)
        if master:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    if master:
        model.module.save_pretrained(os.path.join(args.out, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
