"""Pairwise (RankNet) product ranker trained from raw search click logs.

Preference pairs use the skip-above heuristic: a clicked product is preferred over
every product shown above it in the same impression that was not clicked.  Pairs
and their tokenization are cached next to the logs because building them from a
week of impressions takes ~20 minutes.

    torchrun --nproc_per_node=8 06_clicklog_pairwise_ranker.py \
        --logs /shared/clicklogs/2024-05-w2 --catalog /shared/catalog/products.parquet
"""
import argparse
import glob
import json
import os
import time
from collections import defaultdict

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", required=True)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--encoder", default="distilbert-base-uncased")
    ap.add_argument("--max_len", type=int, default=96)
    ap.add_argument("--batch_size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--dev_days", type=int, default=1, help="last N days of logs are held out")
    ap.add_argument("--save_dir", default="/shared/ckpt/pairwise_ranker")
    return ap.parse_args()


def skip_above_pairs(impressions):
    """impressions: DataFrame with impression_id, query, position, product_id, clicked."""
    pairs = []
    for _, imp in impressions.groupby("impression_id", sort=False):
        imp = imp.sort_values("position")
        shown = list(zip(imp.product_id, imp.clicked))
        query = imp["query"].iloc[0]
        for i, (pid, clicked) in enumerate(shown):
            if not clicked:
                continue
            for above_pid, above_clicked in shown[:i]:
                if not above_clicked:
                    pairs.append((query, pid, above_pid))
    return pairs


def build_cache(args, tok, cache_path):
    files = sorted(glob.glob(os.path.join(args.logs, "day=*", "*.parquet")))
    days = sorted({os.path.basename(os.path.dirname(f)) for f in files})
    dev_days = set(days[-args.dev_days:])
    catalog = pd.read_parquet(args.catalog, columns=["product_id", "title", "brand"])
    title = {p: f"{t} ({b})" if b else t for p, t, b in zip(catalog.product_id, catalog.title, catalog.brand)}

    out = {"train": [], "dev": []}
    for f in files:
        split = "dev" if os.path.basename(os.path.dirname(f)) in dev_days else "train"
        imps = pd.read_parquet(f, columns=["impression_id", "query", "position", "product_id", "clicked"])
        out[split] += [(q, title[a], title[b]) for q, a, b in skip_above_pairs(imps) if a in title and b in title]

    cache = {}
    for split, triples in out.items():
        qs, a, b = zip(*triples)
        enc_a = tok(list(qs), list(a), truncation=True, max_length=args.max_len, padding="max_length", return_tensors="pt")
        enc_b = tok(list(qs), list(b), truncation=True, max_length=args.max_len, padding="max_length", return_tensors="pt")
        cache[split] = {
            "a_ids": enc_a["input_ids"].to(torch.int32), "a_mask": enc_a["attention_mask"].to(torch.int8),
            "b_ids": enc_b["input_ids"].to(torch.int32), "b_mask": enc_b["attention_mask"].to(torch.int8),
        }
    torch.save(cache, cache_path)
    return cache


class PairSet(Dataset):
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return self.t["a_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i].long() for k, v in self.t.items()}


class Scorer(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)
        hid = self.enc.config.dim if hasattr(self.enc.config, "dim") else self.enc.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(hid, 1))

    def score(self, ids, mask):
        return self.head(self.enc(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]).squeeze(-1)

    def forward(self, a_ids, a_mask, b_ids, b_mask):
        # one encoder call over both sides of the pair
        s = self.score(torch.cat([a_ids, b_ids]), torch.cat([a_mask, b_mask]))
        return s[: a_ids.size(0)], s[a_ids.size(0):]


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    cache_path = os.path.join(args.logs, f"pairs_{args.encoder.replace('/', '_')}_{args.max_len}.pt")
    t0 = time.time()
    if os.path.exists(cache_path):
        cache = torch.load(cache_path)
    else:
        cache = build_cache(args, tok, cache_path)
    if rank == 0:
        print(f"pairs ready in {time.time() - t0:.0f}s: train {cache['train']['a_ids'].shape[0]:,} "
              f"dev {cache['dev']['a_ids'].shape[0]:,}", flush=True)

    train_ds, dev_ds = PairSet(cache["train"]), PairSet(cache["dev"])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=512, sampler=dev_sampler, num_workers=4, pin_memory=True)

    model = Scorer(args.encoder).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                sa, sb = model(b["a_ids"], b["a_mask"], b["b_ids"], b["b_mask"])
            # RankNet: P(a > b) = sigmoid(sa - sb), target always 1
            loss = F.softplus(-(sa.float() - sb.float())).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        # dev: pairwise accuracy on held-out days
        raw = model.module
        raw.eval()
        correct = torch.zeros((), device=device)
        seen = torch.zeros((), device=device)
        with torch.no_grad():
            for b in dev_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                with torch.autocast("cuda", dtype=torch.float16):
                    sa, sb = raw(b["a_ids"], b["a_mask"], b["b_ids"], b["b_mask"])
                correct += (sa > sb).sum()
                seen += sa.numel()
        dist.all_reduce(correct)
        dist.all_reduce(seen)
        if rank == 0:
            acc = (correct / seen).item()
            print(f"epoch {epoch} dev pairwise acc {acc:.4f}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": raw.state_dict(), "epoch": epoch, "dev_acc": acc, "encoder": args.encoder},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))
            with open(os.path.join(args.save_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "dev_pair_acc": acc}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
