"""DCN-v2 fraud scorer with an auxiliary fraud-typology head.

Main task   : is_fraud (binary, ~0.1% positive)
Aux task    : fraud typology for confirmed fraud (account takeover / stolen card /
              first-party / merchant collusion / other), supervised only on fraud rows.

    torchrun --nproc_per_node=4 13_dcn_multitask_fraud_type.py --data /data/cards/2024 --aux-weight 0.3
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FRAUD_TYPES = ["ato", "stolen_card", "first_party", "collusion", "other"]
logger = logging.getLogger("dcn")


class CardTxnDataset(Dataset):
    def __init__(self, df, num_cols, cat_cols, stats):
        x = df[num_cols].to_numpy(np.float32)
        self.num = np.nan_to_num((x - stats[0]) / stats[1])
        self.cat = df[cat_cols].to_numpy(np.int64)
        self.y = df["is_fraud"].to_numpy(np.float32)
        ftype = df["fraud_type"].map({t: i for i, t in enumerate(FRAUD_TYPES)})
        self.ftype = ftype.fillna(-100).to_numpy(np.int64)   # ignore_index for non-fraud rows

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.num[i], self.cat[i], self.y[i], self.ftype[i]


class CrossLayer(nn.Module):
    def __init__(self, d, rank=64):
        super().__init__()
        self.u = nn.Linear(d, rank, bias=False)
        self.v = nn.Linear(rank, d)

    def forward(self, x0, x):
        return x0 * self.v(self.u(x)) + x


class DCNv2(nn.Module):
    def __init__(self, n_num, cat_cards, emb_dim=16, n_cross=3, deep=(512, 256), n_types=len(FRAUD_TYPES)):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cat_cards)
        d = n_num + emb_dim * len(cat_cards)
        self.cross = nn.ModuleList(CrossLayer(d) for _ in range(n_cross))
        layers, k = [], d
        for h in deep:
            layers += [nn.Linear(k, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1)]
            k = h
        self.deep = nn.Sequential(*layers)
        self.fraud_head = nn.Linear(d + k, 1)
        self.type_head = nn.Sequential(nn.Linear(d + k, 64), nn.ReLU(), nn.Linear(64, n_types))

    def forward(self, num, cat):
        x0 = torch.cat([num] + [e(cat[:, i]) for i, e in enumerate(self.embs)], dim=1)
        xc = x0
        for layer in self.cross:
            xc = layer(x0, xc)
        h = torch.cat([xc, self.deep(x0)], dim=1)
        return self.fraud_head(h).squeeze(1), self.type_head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/dcn_mt")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--pos-weight", type=float, default=25.0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    train = pd.read_parquet(os.path.join(args.data, "train.parquet"))
    val = pd.read_parquet(os.path.join(args.data, "val.parquet"))
    num_cols = [c for c in train.columns if c.startswith("n_")]
    cat_cols = [c for c in train.columns if c.startswith("c_")]
    cat_cards = [int(max(train[c].max(), val[c].max())) + 1 for c in cat_cols]
    x = train[num_cols].to_numpy(np.float32)
    stats = (np.nanmean(x, 0), np.nanstd(x, 0) + 1e-6)

    train_ds = CardTxnDataset(train, num_cols, cat_cols, stats)
    val_ds = CardTxnDataset(val, num_cols, cat_cols, stats)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)

    net = DCNv2(len(num_cols), cat_cards)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats_t = torch.zeros(3, device=device)
        for num, cat, y, ftype in train_dl:
            num, cat = num.to(device, non_blocking=True), cat.to(device, non_blocking=True)
            y, ftype = y.to(device), ftype.to(device)
            logit, type_logits = model(num, cat)
            loss = F.binary_cross_entropy_with_logits(logit, y, pos_weight=pos_weight)
            is_fraud = ftype >= 0
            if is_fraud.any():
                aux = F.cross_entropy(type_logits[is_fraud], ftype[is_fraud])
                loss = loss + args.aux_weight * aux
                stats_t[1] += aux.detach()
                stats_t[2] += 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats_t[0] += loss.detach()
        sched.step()
        dist.all_reduce(stats_t)

        if rank == 0:
            net.eval()
            with torch.no_grad():
                ps, tys = [], []
                for i in range(0, len(val_ds), 16384):
                    num = torch.from_numpy(val_ds.num[i:i + 16384]).to(device)
                    cat = torch.from_numpy(val_ds.cat[i:i + 16384]).to(device)
                    logit, tl = net(num, cat)
                    ps.append(torch.sigmoid(logit).cpu().numpy())
                    tys.append(tl.argmax(1).cpu().numpy())
                p, tpred = np.concatenate(ps), np.concatenate(tys)
            ap_score = average_precision_score(val_ds.y, p)
            fm = val_ds.ftype >= 0
            type_f1 = f1_score(val_ds.ftype[fm], tpred[fm], average="macro") if fm.any() else float("nan")
            logger.info("epoch %d loss %.4f aux %.4f | val PR-AUC %.4f type-F1 %.3f | %.0fs", epoch,
                        stats_t[0].item() / (len(train_dl) * world), stats_t[1].item() / max(stats_t[2].item(), 1),
                        ap_score, type_f1, time.time() - t0)
            if ap_score > best:
                best = ap_score
                torch.save({"model": net.state_dict(), "num_cols": num_cols, "cat_cols": cat_cols,
                            "cat_cards": cat_cards, "stats": stats}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
