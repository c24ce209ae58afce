"""In-context tabular classifier (TabPFN-style) trained on a corpus of real OpenML tables.

    torchrun --nproc_per_node=8 10_tabular_icl_pretrain.py conf=configs/tab_icl.yaml train.lr=3e-4
"""
import glob
import hashlib
import os
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BASE = OmegaConf.create("""
data:
  csv_dir: /data/openml_cc18_plus
  cache_dir: /data/cache/tab_icl
  max_features: 100
  max_classes: 10
  min_rows: 200
model:
  d: 512
  layers: 12
  heads: 8
train:
  episodes_per_epoch: 200000
  n_ctx: 512
  n_qry: 128
  bsz: 16
  lr: 1e-4
  epochs: 30
  out: ckpt/tab_icl
""")


def quantile_normalize(x):
    # rank-gauss per column, robust to the crazy scales in OpenML
    r = x.argsort(0).argsort(0).astype(np.float32)
    return (r / max(len(x) - 1, 1) - 0.5) * 3.4


def preprocess_table(path, max_features, max_classes, min_rows):
    df = pd.read_csv(path)
    y_raw = df.iloc[:, -1]
    X = df.iloc[:, :-1]
    X = pd.get_dummies(X, dummy_na=True).astype(np.float32).fillna(0.0).to_numpy()
    if X.shape[0] < min_rows or X.shape[1] == 0:
        return None
    classes, y = np.unique(y_raw.astype(str), return_inverse=True)
    if len(classes) < 2 or len(classes) > max_classes:
        return None
    X = quantile_normalize(X[:, :max_features])
    return torch.from_numpy(X), torch.from_numpy(y.astype(np.int64))


def load_corpus(cfg):
    files = sorted(glob.glob(os.path.join(cfg.data.csv_dir, "*.csv")))
    key = hashlib.md5(("|".join(files) + str(cfg.data.max_features)).encode()).hexdigest()[:10]
    cache = os.path.join(cfg.data.cache_dir, f"corpus_{key}.pt")
    if not os.path.exists(cache):
        os.makedirs(cfg.data.cache_dir, exist_ok=True)
        tables = []
        for f in files:
            t = preprocess_table(f, cfg.data.max_features, cfg.data.max_classes, cfg.data.min_rows)
            if t is not None:
                tables.append(t)
        torch.save(tables, cache)
    return torch.load(cache)


class EpisodeSampler(Dataset):
    """Index i -> a deterministic random episode (table, context rows, query rows, feature subset)."""

    def __init__(self, tables, n_ctx, n_qry, n_feat, n_episodes, seed=0):
        self.tables, self.n_ctx, self.n_qry, self.n_feat = tables, n_ctx, n_qry, n_feat
        self.n, self.seed = n_episodes, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = np.random.default_rng((self.seed, i))
        X, y = self.tables[g.integers(len(self.tables))]
        rows = g.choice(len(X), size=self.n_ctx + self.n_qry, replace=len(X) < self.n_ctx + self.n_qry)
        cols = g.permutation(X.shape[1])[: g.integers(1, X.shape[1] + 1)]
        x = torch.zeros(len(rows), self.n_feat)
        x[:, : len(cols)] = X[rows][:, cols]
        perm = torch.from_numpy(g.permutation(int(y.max()) + 1))  # shuffle class ids
        return x, perm[y[rows]]


class TabICL(nn.Module):
    def __init__(self, n_feat, n_cls, d, layers, heads):
        super().__init__()
        self.x_enc = nn.Linear(n_feat, d)
        self.y_enc = nn.Embedding(n_cls + 1, d)  # last id = "unknown" for query rows
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, layers)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, n_cls))
        self.n_cls = n_cls

    def forward(self, x, y_ctx, n_ctx):
        B, N, _ = x.shape
        y_in = torch.full((B, N), self.n_cls, device=x.device, dtype=torch.long)
        y_in[:, :n_ctx] = y_ctx
        h = self.x_enc(x) + self.y_enc(y_in)
        # every row attends to the context rows only
        mask = torch.ones(N, N, dtype=torch.bool, device=x.device)
        mask[:, :n_ctx] = False
        h = self.tf(h, mask=mask)
        return self.head(h[:, n_ctx:])


def main():
    cli = OmegaConf.from_cli(sys.argv[1:])
    cfg = BASE
    if "conf" in cli:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(cli.pop("conf")))
    cfg = OmegaConf.merge(cfg, cli)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tables = load_corpus(cfg)
    if rank == 0:
        print(f"{len(tables)} tables in corpus", flush=True)
    n_ctx, n_qry = cfg.train.n_ctx, cfg.train.n_qry
    ds = EpisodeSampler(tables, n_ctx, n_qry, cfg.data.max_features, cfg.train.episodes_per_epoch)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=cfg.train.bsz, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    torch.manual_seed(0)
    model = TabICL(cfg.data.max_features, cfg.data.max_classes, cfg.model.d, cfg.model.layers,
                   cfg.model.heads).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    total = len(dl) * cfg.train.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.train.lr, total_steps=total, pct_start=0.02)

    for epoch in range(cfg.train.epochs):
        sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(3, device=dev)
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, y[:, :n_ctx], n_ctx)
            y_q = y[:, n_ctx:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y_q.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach() * y_q.numel(),
                                  (logits.argmax(-1) == y_q).sum().float(),
                                  torch.tensor(float(y_q.numel()), device=dev)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} loss {meter[0] / meter[2]:.4f} qry_acc {meter[1] / meter[2]:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(cfg.train.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "cfg": OmegaConf.to_container(cfg),
                        "epoch": epoch}, os.path.join(cfg.train.out, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
