"""FT-Transformer for credit-default scoring, SageMaker multi-instance training.

PyTorch(entry_point="train_ftt.py", source_dir="src",
        instance_type="ml.g5.48xlarge", instance_count=3,          # 8 x A10G each
        framework_version="2.2", py_version="py310",
        distribution={"torch_distributed": {"enabled": True}},
        hyperparameters={"epochs": 30, "batch-size": 1024, "d-token": 192})
inputs: train / valid / test channels (parquet, FastFile mode from s3://risk-ml/credit/v5/)
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("ftt")

NUM_COLS = ["income", "loan_amnt", "int_rate", "installment", "dti", "revol_util", "revol_bal",
            "open_acc", "total_acc", "annual_inc_joint", "emp_length", "fico_low", "fico_high",
            "delinq_2yrs", "inq_last_6mths", "mths_since_last_delinq", "pub_rec", "mort_acc"]
CAT_COLS = ["grade", "sub_grade", "home_ownership", "purpose", "addr_state", "verification_status",
            "application_type", "term"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--d-token", type=int, default=192)
    ap.add_argument("--n-blocks", type=int, default=3)
    ap.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAIN"))
    ap.add_argument("--valid", default=os.environ.get("SM_CHANNEL_VALID"))
    ap.add_argument("--test", default=os.environ.get("SM_CHANNEL_TEST"))
    ap.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
    return ap.parse_args()


def load_table(path, stats=None):
    df = pd.read_parquet(path)
    if stats is None:
        stats = {
            "mean": df[NUM_COLS].mean().to_dict(),
            "std": df[NUM_COLS].std().replace(0, 1).to_dict(),
            "cats": {c: sorted(df[c].astype(str).unique().tolist()) for c in CAT_COLS},
        }
    num = ((df[NUM_COLS].fillna(pd.Series(stats["mean"])) - pd.Series(stats["mean"])) / pd.Series(stats["std"]))
    cats = np.stack([
        df[c].astype(str).map({v: i + 1 for i, v in enumerate(stats["cats"][c])}).fillna(0).astype(int).values
        for c in CAT_COLS], axis=1)
    y = df["default"].astype(np.float32).values
    ds = TensorDataset(torch.tensor(num.values, dtype=torch.float32), torch.tensor(cats), torch.tensor(y))
    return ds, stats


class FTTransformer(nn.Module):
    def __init__(self, n_num, cat_cards, d, n_blocks):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat_emb = nn.ModuleList([nn.Embedding(card + 1, d) for card in cat_cards])
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=int(d * 4 / 3), dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_blocks)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        tok_num = x_num.unsqueeze(-1) * self.num_w + self.num_b
        tok_cat = torch.stack([emb(x_cat[:, i]) for i, emb in enumerate(self.cat_emb)], dim=1)
        x = torch.cat([self.cls.expand(x_num.size(0), -1, -1), tok_num, tok_cat], dim=1)
        return self.head(self.encoder(x)[:, 0]).squeeze(-1)


@torch.no_grad()
def score(model, loader, device, world):
    model.eval()
    probs, labels = [], []
    for x_num, x_cat, y in loader:
        p = torch.sigmoid(model(x_num.to(device), x_cat.to(device)))
        probs.append(p.cpu())
        labels.append(y)
    parts = [None] * world
    dist.all_gather_object(parts, (torch.cat(probs).numpy(), torch.cat(labels).numpy()))
    model.train()
    p = np.concatenate([a for a, _ in parts])
    t = np.concatenate([b for _, b in parts])
    return roc_auc_score(t, p), float(np.mean((p - t) ** 2))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_ds, stats = load_table(args.train)
    valid_ds, _ = load_table(args.valid, stats)
    test_ds, _ = load_table(args.test, stats)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=11)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=4096, num_workers=2)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=4096, num_workers=2)

    cards = [len(stats["cats"][c]) for c in CAT_COLS]
    model = FTTransformer(len(NUM_COLS), cards, args.d_token, args.n_blocks).to(device)
    model = DDP(model, device_ids=[local_rank])
    pos_rate = float(train_ds.tensors[2].mean())
    pos_weight = torch.tensor((1 - pos_rate) / pos_rate, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)

    best_path = os.path.join(args.model_dir, "ftt_best.pt")
    best_auc, patience, bad_epochs = 0.0, 5, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x_num, x_cat, y in train_dl:
            x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x_num, x_cat), y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        auc, brier = score(model, valid_dl, device, world)
        log.info("epoch %d valid_auc=%.5f brier=%.5f (%.1fs)", epoch, auc, brier, time.time() - t0)
        if auc > best_auc:
            best_auc, bad_epochs = auc, 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "stats": stats, "epoch": epoch}, best_path)
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= patience:
            log.info("early stopping at epoch %d", epoch)
            break

    # final numbers come from the best epoch, not the last one
    best = torch.load(best_path, map_location=device)
    model.module.load_state_dict(best["model"])
    test_auc, test_brier = score(model, test_dl, device, world)
    log.info("best epoch %d: test_auc=%.5f test_brier=%.5f", best["epoch"], test_auc, test_brier)
    if rank == 0:
        with open(os.path.join(args.model_dir, "metrics.json"), "w") as f:
            json.dump({"valid_auc": best_auc, "test_auc": test_auc, "test_brier": test_brier}, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
