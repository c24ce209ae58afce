"""FT-Transformer for subscriber churn prediction on the monthly feature snapshot.

    accelerate launch --multi_gpu --num_processes 4 20_churn_ft_transformer.py \
        --train data/churn_train.parquet --valid data/churn_valid.parquet --out runs/churn_ftt
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.utils.data import DataLoader, TensorDataset

TARGET = "churned_next_30d"


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d):
        super().__init__()
        self.num_weight = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_bias = nn.Parameter(torch.zeros(n_num, d))
        self.cat_embs = nn.ModuleList([nn.Embedding(c + 1, d) for c in cat_cardinalities])
        self.cls = nn.Parameter(torch.zeros(1, 1, d))

    def forward(self, x_num, x_cat):
        tokens = x_num.unsqueeze(-1) * self.num_weight + self.num_bias
        cats = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_embs)], dim=1)
        tokens = torch.cat([tokens, cats], dim=1)
        return torch.cat([self.cls.expand(tokens.size(0), -1, -1), tokens], dim=1)


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cardinalities, d=192, depth=3, heads=8, dropout=0.15):
        super().__init__()
        self.tokenizer = FeatureTokenizer(n_num, cat_cardinalities, d)
        layer = nn.TransformerEncoderLayer(d, heads, d * 4 // 3 * 2, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        h = self.encoder(self.tokenizer(x_num, x_cat))
        return self.head(h[:, 0]).squeeze(-1)


def load_frame(path, num_cols, cat_cols, stats=None, vocab=None):
    df = pd.read_parquet(path)
    if stats is None:
        stats = {c: (float(df[c].mean()), float(df[c].std() + 1e-6)) for c in num_cols}
    if vocab is None:
        vocab = {c: {v: i + 1 for i, v in enumerate(sorted(df[c].astype(str).unique()))} for c in cat_cols}
    x_num = np.stack([((df[c].fillna(stats[c][0]) - stats[c][0]) / stats[c][1]).values for c in num_cols], 1)
    x_cat = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).values for c in cat_cols], 1)
    y = df[TARGET].values.astype(np.float32)
    ds = TensorDataset(torch.tensor(x_num, dtype=torch.float32), torch.tensor(x_cat, dtype=torch.long),
                       torch.tensor(y))
    return ds, stats, vocab


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--schema", default="configs/churn_schema.json")
    ap.add_argument("--out", default="runs/churn_ftt")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)
    with open(args.schema) as f:
        schema = json.load(f)
    num_cols, cat_cols = schema["numeric"], schema["categorical"]

    train_ds, stats, vocab = load_frame(args.train, num_cols, cat_cols)
    valid_ds, _, _ = load_frame(args.valid, num_cols, cat_cols, stats, vocab)
    pos_rate = float(train_ds.tensors[2].mean())
    accelerator.print(f"train {len(train_ds)} valid {len(valid_ds)} positive rate {pos_rate:.3%}")

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=2)
    valid_loader = DataLoader(valid_ds, batch_size=4096, num_workers=2)

    model = FTTransformer(len(num_cols), [len(vocab[c]) for c in cat_cols])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
    pos_weight = torch.tensor((1 - pos_rate) / pos_rate, device=accelerator.device)

    os.makedirs(args.out, exist_ok=True)
    best_ap, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        tot = torch.zeros(2, device=accelerator.device)
        for x_num, x_cat, y in train_loader:
            logits = model(x_num, x_cat)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            tot += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=y.device)])
        tot = accelerator.reduce(tot)

        model.eval()
        scores, targets = [], []
        with torch.no_grad():
            for x_num, x_cat, y in valid_loader:
                p = torch.sigmoid(model(x_num, x_cat))
                p, y = accelerator.gather_for_metrics((p, y))
                scores.append(p.cpu())
                targets.append(y.cpu())
        scores, targets = torch.cat(scores).numpy(), torch.cat(targets).numpy()
        auc, ap = roc_auc_score(targets, scores), average_precision_score(targets, scores)
        accelerator.print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} AUC {auc:.4f} AP {ap:.4f}")

        accelerator.wait_for_everyone()
        if ap > best_ap:
            best_ap, bad_epochs = ap, 0
            torch.save({
                "model": accelerator.unwrap_model(model).state_dict(),
                "stats": stats,
                "vocab": vocab,
                "schema": schema,
                "epoch": epoch,
                "val_auc": auc,
                "val_ap": ap,
            }, os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                accelerator.print(f"early stop at epoch {epoch}, best AP {best_ap:.4f}")
                break

    if accelerator.is_main_process:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"best_val_ap": best_ap}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
