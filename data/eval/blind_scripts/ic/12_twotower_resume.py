"""Two-tower retrieval for product search with categorical product features.

Query tower: MiniLM + projection.  Product tower: MiniLM over the title plus learned
embeddings for brand, leaf category and price bucket.  Trained on click logs with
in-batch negatives + one random same-category negative.  Preemptible cluster, so
the run checkpoints every `save_every` steps and resumes automatically.

    torchrun --nproc_per_node=8 12_twotower_resume.py --work_dir /mnt/efs/runs/tt_cat_v2 --data /mnt/efs/data/clicks_v2
"""
import argparse
import glob
import os
import random
import re
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

PRICE_EDGES = np.array([5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000])


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work_dir", required=True)
    ap.add_argument("--encoder", default="sentence-transformers/all-MiniLM-L12-v2")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--temperature", type=float, default=0.05)
    return ap.parse_args()


class ProductTower(nn.Module):
    def __init__(self, encoder, n_brand, n_cat, dim):
        super().__init__()
        self.text = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        h = self.text.config.hidden_size
        self.brand = nn.Embedding(n_brand, 64)
        self.cat = nn.Embedding(n_cat, 64)
        self.price = nn.Embedding(len(PRICE_EDGES) + 1, 16)
        self.proj = nn.Sequential(nn.Linear(h + 144, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, ids, mask, brand, cat, price):
        t = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(t.dtype)
        t = (t * m).sum(1) / m.sum(1).clamp(min=1)
        x = torch.cat([t, self.brand(brand), self.cat(cat), self.price(price)], dim=-1)
        return F.normalize(self.proj(x), dim=-1)


class QueryTower(nn.Module):
    def __init__(self, encoder, dim):
        super().__init__()
        self.text = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        self.proj = nn.Linear(self.text.config.hidden_size, dim)

    def forward(self, ids, mask):
        t = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(t.dtype)
        return F.normalize(self.proj((t * m).sum(1) / m.sum(1).clamp(min=1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, encoder, n_brand, n_cat, dim):
        super().__init__()
        self.query = QueryTower(encoder, dim)
        self.product = ProductTower(encoder, n_brand, n_cat, dim)

    def forward(self, q, p):
        return self.query(*q), self.product(*p)


class ClickData(Dataset):
    def __init__(self, clicks, products, by_cat):
        self.clicks, self.products, self.by_cat = clicks, products, by_cat

    def __len__(self):
        return len(self.clicks)

    def __getitem__(self, i):
        query, pid = self.clicks[i]
        pos = self.products[pid]
        same_cat = self.by_cat[pos["cat"]]
        neg = self.products[random.choice(same_cat)] if len(same_cat) > 1 else self.products[random.choice(list(self.products))]
        return query, pos, neg


def load_products(path):
    df = pd.read_parquet(path)
    brand_ix = {b: i + 1 for i, b in enumerate(sorted(df.brand.dropna().unique()))}
    cat_ix = {c: i for i, c in enumerate(sorted(df.leaf_category.unique()))}
    products, by_cat = {}, {}
    for r in df.itertuples():
        c = cat_ix[r.leaf_category]
        products[r.product_id] = {"title": r.title, "brand": brand_ix.get(r.brand, 0), "cat": c,
                                  "price": int(np.searchsorted(PRICE_EDGES, r.price))}
        by_cat.setdefault(c, []).append(r.product_id)
    return products, by_cat, len(brand_ix) + 1, len(cat_ix)


def latest_checkpoint(work_dir):
    ckpts = glob.glob(os.path.join(work_dir, "step_*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))


@torch.no_grad()
def dev_mrr(raw, dev_pairs, products, collate, device, rank, world, pool=1024):
    """MRR of the clicked product among `pool` dev products scored together (query-level dev split)."""
    raw.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    chunks = [dev_pairs[i:i + pool] for i in range(0, len(dev_pairs) - pool + 1, pool)]
    for chunk in chunks[rank::world]:
        (q, p) = collate([(qq, products[pid], products[pid]) for qq, pid in chunk])
        qe = raw.query(*(x.to(device) for x in q))
        n = len(chunk)
        pe = raw.product(*(x[:n].to(device) for x in p))
        scores = qe @ pe.T
        ranks = (scores > scores.diagonal().unsqueeze(1)).sum(1) + 1
        acc[0] += (1.0 / ranks.double()).sum()
        acc[1] += n
    dist.all_reduce(acc)
    raw.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    products, by_cat, n_brand, n_cat = load_products(os.path.join(args.data, "products.parquet"))
    clicks_df = pd.read_parquet(os.path.join(args.data, "clicks_train.parquet"), columns=["query", "product_id"])
    clicks = [(q, p) for q, p in zip(clicks_df["query"], clicks_df.product_id) if p in products]
    dev_df = pd.read_parquet(os.path.join(args.data, "clicks_dev.parquet"), columns=["query", "product_id"])
    dev_pairs = [(q, p) for q, p in zip(dev_df["query"], dev_df.product_id) if p in products]
    tok = AutoTokenizer.from_pretrained(args.encoder)

    def collate(batch):
        qs, pos, neg = zip(*batch)
        items = list(pos) + list(neg)
        q = tok(list(qs), padding=True, truncation=True, max_length=32, return_tensors="pt")
        t = tok([it["title"] for it in items], padding=True, truncation=True, max_length=64, return_tensors="pt")
        return ((q["input_ids"], q["attention_mask"]),
                (t["input_ids"], t["attention_mask"], torch.tensor([it["brand"] for it in items]),
                 torch.tensor([it["cat"] for it in items]), torch.tensor([it["price"] for it in items])))

    ds = ClickData(clicks, products, by_cat)
    sampler = DistributedSampler(ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)

    model = TwoTower(args.encoder, n_brand, n_cat, args.dim).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05,
                                                anneal_strategy="linear")

    step = 0
    resume_from = latest_checkpoint(args.work_dir)
    if resume_from:
        ckpt = torch.load(resume_from)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {step}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    start_epoch, skip = divmod(step, len(loader))
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (q, p) in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue
            q = tuple(x.to(device, non_blocking=True) for x in q)
            p = tuple(x.to(device, non_blocking=True) for x in p)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qe, pe = model(q, p)
            logits = qe.float() @ pe.float().T / args.temperature
            loss = F.cross_entropy(logits, torch.arange(qe.size(0), device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step}/{total_steps} epoch {epoch} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(args.work_dir, exist_ok=True)
                    tmp = os.path.join(args.work_dir, f".step_{step}.pt.tmp")
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "step": step}, tmp)
                    os.replace(tmp, os.path.join(args.work_dir, f"step_{step}.pt"))
                    for old in sorted(glob.glob(os.path.join(args.work_dir, "step_*.pt")),
                                      key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))[:-3]:
                        os.remove(old)
                dist.barrier()

        mrr = dev_mrr(model.module, dev_pairs, products, collate, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev MRR (pool 1024) {mrr:.4f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.work_dir, "final_model.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
