"""BERT4Rec on Taobao UserBehavior (click events only), tracked with Weights & Biases.

    torchrun --nproc_per_node=8 09_bert4rec_wandb.py \
        --data /mnt/data/taobao/UserBehavior_clicks.parquet --project seqrec --run_name b4r-taobao
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def args_from_cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--project", default="seqrec")
    p.add_argument("--run_name", default=None)
    p.add_argument("--ckpt_dir", default="/mnt/ckpt/bert4rec_taobao")
    p.add_argument("--min_user_len", type=int, default=5)
    p.add_argument("--min_item_cnt", type=int, default=10)
    p.add_argument("--max_len", type=int, default=100)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--mask_prob", type=float, default=0.2)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--num_neg", type=int, default=100)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


def build_sequences(path, min_user_len, min_item_cnt):
    df = pd.read_parquet(path, columns=["user_id", "item_id", "ts"])
    cnt = df["item_id"].value_counts()
    df = df[df["item_id"].isin(cnt.index[cnt >= min_item_cnt])]
    ulen = df.groupby("user_id")["item_id"].transform("size")
    df = df[ulen >= min_user_len]
    df["iid"] = df["item_id"].rank(method="dense").astype(np.int64)  # 1..N, deterministic
    df = df.sort_values(["user_id", "ts"], kind="mergesort")
    seqs = df.groupby("user_id", sort=True)["iid"].agg(list).tolist()
    return seqs, int(df["iid"].max())


class Cloze(Dataset):
    def __init__(self, seqs, n_items, max_len, mask_prob):
        self.seqs, self.n_items, self.max_len, self.mask_prob = seqs, n_items, max_len, mask_prob
        self.mask_id = n_items + 1

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][:-2][-self.max_len:]
        tok = torch.tensor(s)
        lab = torch.zeros_like(tok)
        m = torch.rand(len(s)) < self.mask_prob
        m[-1] = m[-1] | (~m.any())
        lab[m] = tok[m]
        tok[m] = self.mask_id
        pad = self.max_len - len(s)
        return F.pad(tok, (pad, 0)), F.pad(lab, (pad, 0))


class Bert4Rec(nn.Module):
    def __init__(self, n_items, max_len, hidden, n_layers, n_heads, dropout):
        super().__init__()
        self.emb = nn.Embedding(n_items + 2, hidden, padding_idx=0)
        self.pos = nn.Embedding(max_len, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, n_heads, hidden * 4, dropout, activation="gelu", batch_first=True),
            n_layers,
        )
        self.proj = nn.Linear(hidden, hidden)
        self.bias = nn.Parameter(torch.zeros(n_items + 2))

    def forward(self, tok, labels=None):
        pos = torch.arange(tok.size(1), device=tok.device)
        h = self.drop(self.ln(self.emb(tok) + self.pos(pos)))
        h = self.enc(h, src_key_padding_mask=tok == 0)
        h = F.gelu(self.proj(h))
        if labels is None:
            return h
        sel = labels > 0
        return F.cross_entropy(self.logits(h[sel]), labels[sel])

    def logits(self, h):
        return h @ self.emb.weight.t() + self.bias


@torch.no_grad()
def evaluate(net, seqs, users, n_items, max_len, n_neg, split, device, seed):
    net.eval()
    rng = random.Random(seed)
    mask_id = n_items + 1
    acc = torch.zeros(5, device=device, dtype=torch.float64)
    for b in range(0, len(users), 512):
        batch = users[b:b + 512]
        toks, cands = [], []
        for u in batch:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            x = (hist + [mask_id])[-max_len:]
            toks.append([0] * (max_len - len(x)) + x)
            seen = set(s)
            c = [tgt]
            while len(c) <= n_neg:
                j = rng.randint(1, n_items)
                if j not in seen:
                    c.append(j)
            cands.append(c)
        toks = torch.tensor(toks, device=device)
        cands = torch.tensor(cands, device=device)
        h = net(toks)[:, -1]
        sc = net.logits(h).gather(1, cands)
        r = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        for j, k in enumerate((5, 10)):
            hit = (r < k).double()
            acc[2 * j] += hit.sum()
            acc[2 * j + 1] += (hit / torch.log2(r + 2)).sum()
        acc[4] += len(batch)
    dist.all_reduce(acc)
    net.train()
    n = acc[4].item()
    return {f"{split}/HR@5": acc[0].item() / n, f"{split}/NDCG@5": acc[1].item() / n,
            f"{split}/HR@10": acc[2].item() / n, f"{split}/NDCG@10": acc[3].item() / n}


def main():
    args = args_from_cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args))

    seqs, n_items = build_sequences(args.data, args.min_user_len, args.min_item_cnt)
    if rank == 0:
        print(f"users={len(seqs)} items={n_items}", flush=True)
        run.config.update({"n_users": len(seqs), "n_items": n_items, "world_size": world})

    ds = Cloze(seqs, n_items, args.max_len, args.mask_prob)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    net = Bert4Rec(n_items, args.max_len, args.hidden, args.n_layers, args.n_heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    eff_lr = args.lr * world * args.batch_size / 1024
    opt = torch.optim.AdamW(model.parameters(), lr=eff_lr, weight_decay=0.01)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=eff_lr, total_steps=total, pct_start=0.05)

    my_users = list(range(rank, len(seqs), world))
    os.makedirs(args.ckpt_dir, exist_ok=True)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for tok, lab in dl:
            tok, lab = tok.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = model(tok, lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        metrics = evaluate(net, seqs, my_users, n_items, args.max_len, args.num_neg, "valid", device, args.seed + rank)
        if rank == 0:
            metrics["epoch_time_s"] = time.time() - t0
            wandb.log(metrics, step=step)
            print(f"epoch {epoch} {metrics}", flush=True)
            if metrics["valid/NDCG@10"] > best:
                best = metrics["valid/NDCG@10"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "n_items": n_items},
                           os.path.join(args.ckpt_dir, "best.pt"))
                wandb.run.summary["best_valid_ndcg10"] = best
        dist.barrier()

    best_state = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
    net.load_state_dict(best_state["model"])
    test = evaluate(net, seqs, my_users, n_items, args.max_len, args.num_neg, "test", device, args.seed + 99 + rank)
    if rank == 0:
        wandb.log(test, step=step)
        print(test, flush=True)
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
