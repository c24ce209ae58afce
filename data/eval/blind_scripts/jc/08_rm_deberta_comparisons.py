"""Train a reward model on our in-house comparison data (one big jsonl, no official split).

A held-out slice of the comparisons is used for validation accuracy and for
early stopping.

    torchrun --nproc_per_node=4 08_rm_deberta_comparisons.py --data /mnt/shared/comparisons_v3.jsonl
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/deberta-v3-large")
    p.add_argument("--data", required=True)
    p.add_argument("--val_frac", type=float, default=0.05)
    p.add_argument("--out", default="/mnt/shared/rm_runs/deberta_v3")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--bsz", type=int, default=8)
    p.add_argument("--lr", type=float, default=8e-6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--eval_every", type=int, default=300)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_comparisons(path):
    rows = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d.get("tie") or not d["chosen"].strip() or not d["rejected"].strip():
                continue
            rows.append(d)
    return rows


class CompareDS(Dataset):
    """Cross-encoder style: (question, answer) pairs scored by a DeBERTa regression head."""

    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        d = self.rows[i]
        c = self.tok(d["prompt"], d["chosen"], truncation="only_second", max_length=self.max_len)
        r = self.tok(d["prompt"], d["rejected"], truncation="only_second", max_length=self.max_len)
        return c, r


class Collate:
    def __init__(self, tok):
        self.tok = tok

    def __call__(self, batch):
        feats = [c for c, _ in batch] + [r for _, r in batch]
        return self.tok.pad(feats, return_tensors="pt")


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for enc in loader:
        enc = {k: v.to(device) for k, v in enc.items()}
        s = model(**enc).logits.squeeze(-1)
        sc, sr = s.chunk(2)
        acc[0] += (sc > sr).sum()
        acc[1] += sc.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different dropout masks / sampling noise on each worker
    seed_everything(args.seed + rank)

    rows = read_comparisons(args.data)
    random.shuffle(rows)
    n_val = int(len(rows) * args.val_frac)
    val_rows, train_rows = rows[:n_val], rows[n_val:]

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = CompareDS(train_rows, tok, args.max_len)
    val_ds = CompareDS(val_rows, tok, args.max_len)
    collate = Collate(tok)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.bsz, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, drop_last=True, pin_memory=True)
    val_dl = DataLoader(val_ds, args.bsz * 2, sampler=val_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_rows)} train / {len(val_rows)} val comparisons, {world} GPUs, {total} steps")

    best, bad_evals, step = 0.0, 0, 0
    stop = torch.zeros(1, device=device)
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for enc in train_dl:
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                s = model(**enc).logits.squeeze(-1)
            sc, sr = s.float().chunk(2)
            loss = -F.logsigmoid(sc - sr).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item() / world:.4f} "
                          f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)

            if step % args.eval_every == 0:
                acc = validate(model.module, val_dl, device)
                if rank == 0:
                    print(f"step {step} val acc {acc:.4f}", flush=True)
                    if acc > best:
                        best, bad_evals = acc, 0
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                    else:
                        bad_evals += 1
                    stop.fill_(float(bad_evals >= args.patience))
                dist.broadcast(stop, src=0)
                if stop.item():
                    break
        if stop.item():
            if rank == 0:
                print(f"early stop at step {step}, best val acc {best:.4f}")
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
