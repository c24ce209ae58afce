"""Card-transaction fraud detection with MosaicML Composer.

Feature-tokenizer transformer (FT-Transformer-lite) over numeric + categorical
columns.  Launch with the composer launcher:

    composer -n 8 07_tabular_fraud_composer.py --data data/transactions.parquet
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from composer import Trainer
from composer.callbacks import LRMonitor, SpeedMonitor
from composer.loggers import FileLogger
from composer.models import ComposerModel
from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW
from composer.utils import dist, reproducibility
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

NUM_COLS = ["amount", "hour", "days_since_last", "merchant_risk", "avg_amount_30d",
            "n_tx_24h", "n_tx_7d", "distance_home_km", "account_age_days"]
CAT_COLS = ["merchant_category", "country", "channel", "card_type", "entry_mode"]


class FraudTable(Dataset):
    def __init__(self, df, cat_maps, stats):
        x = df[NUM_COLS].astype(np.float32)
        x["amount"] = np.log1p(x["amount"].clip(lower=0))
        self.num = ((x - stats["mean"]) / stats["std"]).fillna(0.0).values.astype(np.float32)
        self.cat = np.stack([df[c].map(cat_maps[c]).fillna(0).astype(np.int64).values
                             for c in CAT_COLS], axis=1)
        self.y = df["is_fraud"].values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"num": torch.from_numpy(self.num[i]), "cat": torch.from_numpy(self.cat[i]),
                "label": torch.tensor(self.y[i])}


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cards, d=64, depth=3, heads=4, dropout=0.1):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat_emb = nn.ModuleList([nn.Embedding(c, d) for c in cat_cards])
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, num, cat):
        t_num = num.unsqueeze(-1) * self.num_w + self.num_b
        t_cat = torch.stack([emb(cat[:, j]) for j, emb in enumerate(self.cat_emb)], dim=1)
        tokens = torch.cat([self.cls.expand(num.size(0), -1, -1), t_num, t_cat], dim=1)
        return self.head(self.encoder(tokens)[:, 0]).squeeze(-1)


class FraudModel(ComposerModel):
    def __init__(self, net, pos_weight):
        super().__init__()
        self.net = net
        self.register_buffer("pos_weight", torch.tensor(pos_weight))
        self.train_auroc = BinaryAUROC()
        self.val_auroc = BinaryAUROC()
        self.val_ap = BinaryAveragePrecision()

    def forward(self, batch):
        return self.net(batch["num"], batch["cat"])

    def loss(self, outputs, batch):
        return F.binary_cross_entropy_with_logits(outputs, batch["label"], pos_weight=self.pos_weight)

    def eval_forward(self, batch, outputs=None):
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train=False):
        if is_train:
            return {"AUROC": self.train_auroc}
        return {"AUROC": self.val_auroc, "AP": self.val_ap}

    def update_metric(self, batch, outputs, metric):
        metric.update(torch.sigmoid(outputs.float()), batch["label"].long())


def build_splits(path):
    df = pd.read_parquet(path)
    df = df.sort_values("timestamp")
    for c in CAT_COLS:
        df[c] = df[c].astype(str)
    cut = int(len(df) * 0.9)
    train_df, val_df = df.iloc[:cut], df.iloc[cut:]
    cat_maps = {c: {v: i + 1 for i, v in enumerate(sorted(train_df[c].unique()))}
                for c in CAT_COLS}
    x = train_df[NUM_COLS].astype(np.float32).copy()
    x["amount"] = np.log1p(x["amount"].clip(lower=0))
    stats = {"mean": x.mean(), "std": x.std() + 1e-6}
    return train_df, val_df, cat_maps, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/transactions.parquet")
    ap.add_argument("--bs", type=int, default=1024, help="per-device batch size")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--run-name", default="fraud-ftt")
    ap.add_argument("--save-folder", default="checkpoints/{run_name}")
    args = ap.parse_args()

    reproducibility.seed_all(1234)
    train_df, val_df, cat_maps, stats = build_splits(args.data)
    train_ds = FraudTable(train_df, cat_maps, stats)
    val_ds = FraudTable(val_df, cat_maps, stats)
    pos_rate = float(train_ds.y.mean())
    if dist.get_global_rank() == 0:
        print(f"train={len(train_ds)} val={len(val_ds)} fraud_rate={pos_rate:.4%}")

    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4096, shuffle=False, num_workers=4, pin_memory=True)

    net = FTTransformer(len(NUM_COLS), [len(cat_maps[c]) + 1 for c in CAT_COLS])
    model = FraudModel(net, pos_weight=min((1 - pos_rate) / max(pos_rate, 1e-6), 50.0))
    optimizer = DecoupledAdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = CosineAnnealingWithWarmupScheduler(t_warmup="1ep", alpha_f=0.05)

    trainer = Trainer(
        model=model,
        train_dataloader=train_dl,
        eval_dataloader=val_dl,
        max_duration=f"{args.epochs}ep",
        eval_interval="1ep",
        optimizers=optimizer,
        schedulers=scheduler,
        device="gpu",
        precision="amp_bf16",
        run_name=args.run_name,
        save_folder=args.save_folder,
        save_interval="1ep",
        save_num_checkpoints_to_keep=3,
        loggers=[FileLogger(filename="logs/{run_name}/rank{rank}.txt")],
        callbacks=[LRMonitor(), SpeedMonitor(window_size=50)],
        seed=1234,
    )
    trainer.fit()
    trainer.close()


if __name__ == "__main__":
    main()
