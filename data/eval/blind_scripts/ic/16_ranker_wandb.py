#!/usr/bin/env python
"""Hybrid product ranker: cross-encoder text relevance fused with behavioural features.

score(q, p) = MLP([CLS(q, p), log-ctr, log-cvr, price z-score within query, rating, #reviews])

Labels are graded from the click log (0 impression only, 1 click, 2 add-to-cart,
3 purchase).  Loss: LambdaLoss-style pairwise logistic with |delta NDCG| weights
inside each query list.  Experiments are tracked in Weights & Biases.

    torchrun --nproc_per_node=8 16_ranker_wandb.py --config configs/hybrid_ranker.yaml
"""
import argparse
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

FEATS = ["log_ctr", "log_cvr", "price_z", "rating", "log_reviews"]


class HybridRanker(nn.Module):
    def __init__(self, name, n_feats):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.feat_proj = nn.Sequential(nn.Linear(n_feats, 64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(h + 64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 1))

    def forward(self, input_ids, attention_mask, feats):
        cls = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return self.head(torch.cat([cls, self.feat_proj(feats)], dim=-1)).squeeze(-1)


class QueryLists(Dataset):
    def __init__(self, df, list_size, train=True):
        self.groups = [g for _, g in df.groupby("query_id", sort=True)]
        if train:
            self.groups = [g for g in self.groups if g.grade.nunique() > 1]
        self.list_size, self.train = list_size, train

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        g = self.groups[i]
        if self.train and len(g) > self.list_size:
            g = g.sample(self.list_size, random_state=random.randint(0, 2 ** 31))
        return g["query"].iloc[0], g.title.tolist(), g[FEATS].to_numpy(np.float32), g.grade.to_numpy(np.float32)


def make_collate(tok, max_len, list_size):
    def collate(batch):
        q_all, t_all, f_all, y_all, valid = [], [], [], [], []
        for q, titles, feats, y in batch:
            n = len(titles)
            pad = list_size - n
            q_all += [q] * list_size
            t_all += titles + [""] * pad
            f_all.append(np.concatenate([feats, np.zeros((pad, feats.shape[1]), np.float32)]))
            y_all.append(np.concatenate([y, np.full(pad, -1, np.float32)]))
        enc = tok(q_all, t_all, truncation="only_second", max_length=max_len, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.from_numpy(np.stack(f_all)), torch.from_numpy(np.stack(y_all))
    return collate


def lambda_loss(s, y):
    valid = y >= 0
    gains = (2 ** y.clamp(min=0) - 1) * valid
    order = s.detach().masked_fill(~valid, -1e9).argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.size(1), device=s.device).expand_as(order))
    disc = 1.0 / torch.log2(rank.float() + 2)
    ideal = gains.sort(-1, descending=True).values
    idcg = (ideal / torch.log2(torch.arange(s.size(1), device=s.device).float() + 2)).sum(-1, keepdim=True).clamp(min=1e-6)
    delta = (gains.unsqueeze(-1) - gains.unsqueeze(-2)).abs() * (disc.unsqueeze(-1) - disc.unsqueeze(-2)).abs() / idcg.unsqueeze(-1)
    pair = (y.unsqueeze(-1) > y.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    diff = s.unsqueeze(-1) - s.unsqueeze(-2)
    return (delta * F.softplus(-diff) * pair).sum() / pair.sum().clamp(min=1)


@torch.no_grad()
def ndcg_sum(s, y, k=10):
    valid = y >= 0
    g = (2 ** y.clamp(min=0) - 1) * valid
    top = s.masked_fill(~valid, -1e9).argsort(-1, descending=True)[:, :k]
    disc = 1.0 / torch.log2(torch.arange(top.size(1), device=s.device).float() + 2)
    dcg = (g.gather(-1, top) * disc).sum(-1)
    idcg = (g.sort(-1, descending=True).values[:, :k] * disc).sum(-1)
    keep = idcg > 0
    return (dcg[keep] / idcg[keep]).sum(), keep.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    run = wandb.init(project=cfg["wandb_project"], name=cfg["run_name"], config=cfg)

    df = pd.read_parquet(cfg["data"])
    train_df, dev_df = df[df.split == "train"], df[df.split == "dev"]  # split is by query_id upstream
    tok = AutoTokenizer.from_pretrained(cfg["encoder"])
    collate = make_collate(tok, cfg["max_len"], cfg["list_size"])
    train_ds = QueryLists(train_df, cfg["list_size"], train=True)
    dev_ds = QueryLists(dev_df, cfg["list_size"], train=False)
    dev_ds.groups = [g.head(cfg["list_size"]) for g in dev_ds.groups]

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["queries_per_gpu"], sampler=train_sampler,
                          collate_fn=collate, num_workers=6, drop_last=True, pin_memory=True)
    dev_idx = list(range(rank, len(dev_ds), world))
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, dev_idx), batch_size=cfg["queries_per_gpu"],
                        collate_fn=collate, num_workers=2)

    raw = HybridRanker(cfg["encoder"], len(FEATS)).to(device)
    model = DDP(raw, device_ids=[local_rank], find_unused_parameters=False)
    opt = torch.optim.AdamW([
        {"params": raw.enc.parameters(), "lr": cfg["lr"]},
        {"params": list(raw.feat_proj.parameters()) + list(raw.head.parameters()), "lr": cfg["head_lr"]},
    ], weight_decay=0.01)
    total = cfg["epochs"] * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(cfg["warmup_frac"] * total), total)
    if rank == 0:
        wandb.watch(raw, log="gradients", log_freq=1000)

    step, best = 0, -1.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for ids, mask, feats, y in train_dl:
            ids, mask, feats, y = ids.to(device), mask.to(device), feats.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s = model(ids, mask, feats.view(-1, len(FEATS))).view(y.shape).float()
            loss = lambda_loss(s, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        raw.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, mask, feats, y in dev_dl:
                ids, mask, feats, y = ids.to(device), mask.to(device), feats.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s = raw(ids, mask, feats.view(-1, len(FEATS))).view(y.shape).float()
                a, b = ndcg_sum(s, y)
                tot[0] += a
                tot[1] += b
        dist.all_reduce(tot)
        ndcg = (tot[0] / tot[1].clamp(min=1)).item()
        wandb.log({"dev/ndcg@10": ndcg}, step=step)
        if rank == 0:
            print(f"epoch {epoch} dev NDCG@10 {ndcg:.4f}", flush=True)
            if ndcg > best:
                best = ndcg
                os.makedirs(cfg["out_dir"], exist_ok=True)
                torch.save(raw.state_dict(), os.path.join(cfg["out_dir"], "best.pt"))
                run.summary["best_ndcg@10"] = best
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
