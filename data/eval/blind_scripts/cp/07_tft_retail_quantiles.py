"""Quantile seq2seq forecaster (TFT-lite) for item/store demand (M5-like panel).

Launch:
    torchrun --nproc_per_node=8 07_tft_retail_quantiles.py --cfg.data_dir=/data/m5 --cfg.epochs=30
"""
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


@dataclass
class Config:
    data_dir: str = "/data/m5"
    out_dir: str = "outputs/tft_lite"
    lookback: int = 112
    horizon: int = 28
    hidden: int = 160
    emb_dim: int = 16
    dropout: float = 0.1
    quantiles: List[float] = field(default_factory=lambda: [0.05, 0.25, 0.5, 0.75, 0.95])
    batch_size: int = 512
    lr: float = 2e-3
    epochs: int = 20
    n_origins: int = 3          # rolling-origin validation folds
    workers: int = 8
    seed: int = 7


def parse_cfg(argv) -> Config:
    cfg = Config()
    for arg in argv:
        key, val = arg.lstrip("-").removeprefix("cfg.").split("=", 1) if "=" in arg else (arg, None)
        f = {f.name: f for f in dataclasses.fields(cfg)}[key]
        setattr(cfg, key, f.type(val) if f.type in (int, float, str) else eval(val))
    return cfg


class DemandWindows(Dataset):
    def __init__(self, sales, price, cal, static, origins, L, H, scale):
        self.sales, self.price, self.cal, self.static = sales, price, cal, static
        self.idx = [(s, o) for o in origins for s in range(sales.shape[0])]
        self.L, self.H, self.scale = L, H, scale

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, o = self.idx[i]
        L, H = self.L, self.H
        sc = self.scale[s]
        past = np.stack([self.sales[s, o - L:o] / sc, self.price[s, o - L:o]], -1)
        fut = self.price[s, o:o + H, None]
        return dict(past=torch.from_numpy(past.astype(np.float32)),
                    cal_past=torch.from_numpy(self.cal[o - L:o]),
                    cal_fut=torch.from_numpy(self.cal[o:o + H]),
                    fut=torch.from_numpy(fut.astype(np.float32)),
                    static=torch.from_numpy(self.static[s]),
                    y=torch.from_numpy((self.sales[s, o:o + H] / sc).astype(np.float32)),
                    scale=torch.tensor(sc, dtype=torch.float32))


class TFTLite(nn.Module):
    def __init__(self, cfg: Config, n_cal, cards):
        super().__init__()
        self.quantiles = list(cfg.quantiles)
        self.horizon = cfg.horizon
        h = cfg.hidden
        self.embs = nn.ModuleList([nn.Embedding(c, cfg.emb_dim) for c in cards])
        self.static_proj = nn.Linear(cfg.emb_dim * len(cards), h)
        self.past_proj = nn.Linear(2 + n_cal, h)
        self.fut_proj = nn.Linear(1 + n_cal, h)
        self.enc = nn.LSTM(h, h, num_layers=2, batch_first=True, dropout=cfg.dropout)
        self.dec = nn.LSTM(h, h, num_layers=2, batch_first=True, dropout=cfg.dropout)
        self.attn = nn.MultiheadAttention(h, 4, dropout=cfg.dropout, batch_first=True)
        self.norm = nn.LayerNorm(h)
        self.out = nn.Linear(h, len(self.quantiles))

    def forward(self, b):
        st = torch.cat([e(b["static"][:, i]) for i, e in enumerate(self.embs)], -1)
        st = torch.tanh(self.static_proj(st))
        xp = self.past_proj(torch.cat([b["past"], b["cal_past"]], -1)) + st[:, None]
        xf = self.fut_proj(torch.cat([b["fut"], b["cal_fut"]], -1)) + st[:, None]
        enc, state = self.enc(xp)
        dec, _ = self.dec(xf, state)
        a, _ = self.attn(dec, enc, enc, need_weights=False)
        return self.out(self.norm(dec + a))  # (B, H, Q)


def pinball(pred, y, qs):
    q = pred.new_tensor(qs).view(1, 1, -1)
    e = y.unsqueeze(-1) - pred
    return torch.max(q * e, (q - 1) * e).mean()


def load_panel(cfg):
    df = pd.read_parquet(os.path.join(cfg.data_dir, "sales_long.parquet"))
    sales = df.pivot(index="id", columns="d", values="sales").fillna(0).to_numpy(np.float32)
    price = df.pivot(index="id", columns="d", values="sell_price").ffill(axis=1).bfill(axis=1)
    price = np.log1p(price.to_numpy(np.float32))
    cal = pd.read_csv(os.path.join(cfg.data_dir, "calendar.csv"))
    calf = np.stack([cal.wday / 7, cal.month / 12, cal.snap_CA, cal.event_name_1.notna()], 1)
    meta = df.drop_duplicates("id").set_index("id").sort_index()
    static = np.stack([meta[c].astype("category").cat.codes for c in
                       ("item_id", "dept_id", "cat_id", "store_id", "state_id")], 1).astype(np.int64)
    return sales, price, calf[:sales.shape[1]].astype(np.float32), static


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)

        sales, price, cal, static = load_panel(cfg)
        T, H, L = sales.shape[1], cfg.horizon, cfg.lookback
        val_origins = [T - H * (k + 1) for k in range(cfg.n_origins)][::-1]
        train_end = val_origins[0]
        # per-series scale from the training period only
        scale = np.maximum(sales[:, :train_end].mean(1), 1.0)
        train_origins = list(range(L, train_end - H + 1, 7))
        mk = lambda o: DemandWindows(sales, price, cal, static, o, L, H, scale)
        self.train_ds = mk(train_origins)
        self.folds = [mk([o]) for o in val_origins]
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, batch_size=cfg.batch_size, sampler=self.sampler,
                                   num_workers=cfg.workers, pin_memory=True, drop_last=True)
        # every fold has exactly n_series windows; pad-free split by series index
        self.fold_dls = [DataLoader(torch.utils.data.Subset(f, range(self.rank, len(f), self.world)),
                                    batch_size=2048, num_workers=2) for f in self.folds]

        cards = (static.max(0) + 1).tolist()
        model = TFTLite(cfg, cal.shape[1], cards).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, factor=0.5, patience=2)

    def _to(self, b):
        return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        mid = self.model.quantiles.index(0.5)
        res = []
        for dl in self.fold_dls:
            acc = torch.zeros(3, device=self.device, dtype=torch.float64)
            for b in dl:
                b = self._to(b)
                p = self.model(b)
                ql = pinball(p, b["y"], self.cfg.quantiles) * b["y"].numel()
                err = (p[..., mid] - b["y"]) * b["scale"][:, None]
                acc += torch.stack([ql.double(), err.abs().sum().double(),
                                    torch.tensor(float(b["y"].numel()), device=self.device).double()])
            dist.all_reduce(acc)
            res.append({"pinball": (acc[0] / acc[2]).item(), "mae": (acc[1] / acc[2]).item()})
        self.model.train()
        return res

    def fit(self):
        cfg, best = self.cfg, float("inf")
        os.makedirs(cfg.out_dir, exist_ok=True)
        for ep in range(cfg.epochs):
            self.sampler.set_epoch(ep)
            t0, s = time.time(), 0.0
            for i, b in enumerate(self.train_dl):
                b = self._to(b)
                loss = pinball(self.model(b), b["y"], cfg.quantiles)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
                self.opt.step()
                s += loss.item()
                if self.rank == 0 and i % 200 == 0:
                    logger.info("ep %d it %d/%d loss %.4f", ep, i, len(self.train_dl), loss.item())
            folds = self.validate()
            score = float(np.mean([f["pinball"] for f in folds]))
            self.sched.step(score)
            if self.rank == 0:
                logger.info("ep %d train %.4f folds %s mean %.4f (%.0fs)", ep, s / len(self.train_dl),
                            folds, score, time.time() - t0)
                if score < best:
                    torch.save({"model": self.model.module.state_dict(), "cfg": dataclasses.asdict(cfg),
                                "epoch": ep, "score": score}, os.path.join(cfg.out_dir, "best.pt"))
            best = min(best, score)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(message)s")
    Trainer(parse_cfg(sys.argv[1:])).fit()
