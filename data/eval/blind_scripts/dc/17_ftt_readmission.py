"""FT-Transformer for 30-day hospital readmission; after training, the best checkpoint is
reloaded and scored on the held-out test table (AUC + calibrated predictions written to CSV).

torchrun --standalone --nproc_per_node=4 17_ftt_readmission.py --config configs/readmit_ftt.json
"""
import argparse
import json
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import brier_score_loss, roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DEFAULTS = {
    "train": "/data/readmit/train.parquet",
    "val": "/data/readmit/val.parquet",
    "test": "/data/readmit/test.parquet",
    "target": "readmit_30d",
    "id_col": "encounter_id",
    "d_token": 96,
    "n_blocks": 3,
    "n_heads": 8,
    "attn_dropout": 0.2,
    "global_batch": 1024,
    "lr": 1e-4,
    "epochs": 25,
    "seed": 0,
    "out": "runs/readmit_ftt",
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    return argparse.Namespace(**cfg)


class Tokenizer(nn.Module):
    def __init__(self, n_num, cards, d):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n_num + 1, d))
        self.b = nn.Parameter(torch.empty(n_num, d))
        nn.init.uniform_(self.w, -1 / math.sqrt(d), 1 / math.sqrt(d))
        nn.init.uniform_(self.b, -1 / math.sqrt(d), 1 / math.sqrt(d))
        self.cat = nn.ModuleList(nn.Embedding(c, d) for c in cards)

    def forward(self, xn, xc):
        ones = torch.ones(len(xn), 1, device=xn.device)
        x = torch.cat([ones, xn], 1)[..., None] * self.w  # first token acts as [CLS]
        x[:, 1:] = x[:, 1:] + self.b
        return torch.cat([x, torch.stack([e(xc[:, i]) for i, e in enumerate(self.cat)], 1)], 1)


class FTT(nn.Module):
    def __init__(self, n_num, cards, cfg):
        super().__init__()
        self.tok = Tokenizer(n_num, cards, cfg.d_token)
        layer = nn.TransformerEncoderLayer(cfg.d_token, cfg.n_heads, 2 * cfg.d_token, cfg.attn_dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, cfg.n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(cfg.d_token), nn.ReLU(), nn.Linear(cfg.d_token, 1))

    def forward(self, xn, xc):
        return self.head(self.enc(self.tok(xn, xc))[:, 0]).squeeze(-1)


def fit_transform(cfg):
    tr, va, te = (pd.read_parquet(p) for p in (cfg.train, cfg.val, cfg.test))
    cat_cols = [c for c in tr.columns if tr[c].dtype == object and c != cfg.id_col]
    num_cols = [c for c in tr.columns if c not in cat_cols + [cfg.target, cfg.id_col]]
    vocabs = {c: pd.Index(np.sort(tr[c].dropna().astype(str).unique())) for c in cat_cols}
    med = tr[num_cols].median()
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, random_state=cfg.seed)
    qt.fit(tr[num_cols].fillna(med).values)

    def enc(df, with_y=True):
        xn = torch.tensor(qt.transform(df[num_cols].fillna(med).values), dtype=torch.float32)
        xc = torch.tensor(np.stack([vocabs[c].get_indexer(df[c].astype(str)) + 1 for c in cat_cols], 1), dtype=torch.long)
        y = torch.tensor(df[cfg.target].values if with_y else np.zeros(len(df)), dtype=torch.float32)
        return TensorDataset(xn, xc, y)

    cards = [len(vocabs[c]) + 1 for c in cat_cols]
    return enc(tr), enc(va), enc(te), te[cfg.id_col].values, te[cfg.target].values, len(num_cols), cards


@torch.no_grad()
def scores(net, ds, device, bs=8192):
    net.eval()
    xn, xc, _ = ds.tensors
    return torch.cat([torch.sigmoid(net(xn[i:i + bs].to(device), xc[i:i + bs].to(device))).cpu()
                      for i in range(0, len(xn), bs)]).numpy()


def sharded_auc(net, ds, rank, world, device):
    xn, xc, y = ds.tensors
    sel = torch.arange(rank, len(y), world)
    s = scores(net, TensorDataset(xn[sel], xc[sel], y[sel]), device)
    parts = [None] * world
    dist.all_gather_object(parts, (sel.numpy(), s))
    idx = np.concatenate([p[0] for p in parts])
    s = np.concatenate([p[1] for p in parts])
    return roc_auc_score(y.numpy()[idx], s)


def predict_test(cfg, n_num, cards, test_ds, ids, y_test, device):
    net = FTT(n_num, cards, cfg).to(device)
    state = torch.load(os.path.join(cfg.out, "best.pt"), map_location=device)
    net.load_state_dict(state)
    s = scores(net, test_ds, device)
    pd.DataFrame({"encounter_id": ids, "p_readmit": s}).to_csv(os.path.join(cfg.out, "test_predictions.csv"), index=False)
    return roc_auc_score(y_test, s), brier_score_loss(y_test, s)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    train_ds, val_ds, test_ds, test_ids, y_test, n_num, cards = fit_transform(cfg)
    model = DDP(FTT(n_num, cards, cfg).to(device), device_ids=[local_rank])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.global_batch // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-5)
    y_tr = train_ds.tensors[2]
    pos_weight = ((1 - y_tr.mean()) / y_tr.mean()).to(device)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        auc = sharded_auc(model.module, val_ds, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch:2d} val_auc {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                torch.save(model.state_dict(), os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        test_auc, brier = predict_test(cfg, n_num, cards, test_ds, test_ids, y_test, device)
        print(f"best val AUC {best:.4f} | test AUC {test_auc:.4f} brier {brier:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
