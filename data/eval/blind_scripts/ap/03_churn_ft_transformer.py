"""Telecom churn: FT-Transformer on the monthly customer snapshot.

Train on snapshots up to --train-end, pick the checkpoint and the decision threshold on
the next month, report on the hold-out month. Multi-GPU with torchrun.
"""
import argparse
import json
import os
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import f1_score, precision_recall_curve, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    data: str = "data/churn/snapshots.parquet"
    out_dir: str = "outputs/churn_ftt"
    train_end: str = "2023-09"
    valid_month: str = "2023-10"
    test_month: str = "2023-11"
    batch_size: int = 1024
    epochs: int = 25
    lr: float = 2e-4
    d_token: int = 64
    n_layers: int = 3
    n_heads: int = 8
    dropout: float = 0.1
    seed: int = 7


CATEGORICAL = ["plan", "region", "payment_method", "contract_type", "handset_brand", "tenure_bucket"]
NUMERIC = ["monthly_charge", "total_charge", "data_gb", "voice_min", "sms_count",
           "support_calls_90d", "late_payments_12m", "discount_pct", "days_to_contract_end"]
LABEL = "churned_next_month"


class ChurnData(Dataset):
    def __init__(self, frame, cat_maps, stats):
        self.cat = torch.tensor(np.stack([frame[c].map(cat_maps[c]).fillna(0).astype("int64").values
                                          for c in CATEGORICAL], axis=1))
        num = (frame[NUMERIC].values.astype(np.float32) - stats["mean"]) / stats["std"]
        self.num = torch.tensor(np.nan_to_num(num), dtype=torch.float32)
        self.y = torch.tensor(frame[LABEL].values, dtype=torch.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, self.cat[i], self.num[i], self.y[i]


class FTTransformer(nn.Module):
    def __init__(self, cards, n_num, d_token, n_layers, n_heads, dropout):
        super().__init__()
        self.cat_embeddings = nn.ModuleList(nn.Embedding(n + 1, d_token) for n in cards)
        self.num_weight = nn.Parameter(torch.randn(n_num, d_token) * 0.02)
        self.num_bias = nn.Parameter(torch.zeros(n_num, d_token))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_token))
        enc = nn.TransformerEncoderLayer(d_token, n_heads, 2 * d_token, dropout, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(enc, n_layers)
        self.out = nn.Sequential(nn.LayerNorm(d_token), nn.ReLU(), nn.Linear(d_token, 1))

    def forward(self, x_cat, x_num):
        cat_tok = torch.stack([e(x_cat[:, j]) for j, e in enumerate(self.cat_embeddings)], 1)
        num_tok = x_num.unsqueeze(-1) * self.num_weight + self.num_bias
        cls = self.cls_token.expand(x_cat.shape[0], -1, -1)
        h = self.transformer(torch.cat([cls, cat_tok, num_tok], 1))
        return self.out(h[:, 0]).squeeze(-1)


def gather_scores(model, loader, device):
    model.eval()
    local = []
    with torch.no_grad():
        for idx, x_cat, x_num, y in loader:
            p = torch.sigmoid(model(x_cat.to(device), x_num.to(device)))
            local.append(np.stack([idx.numpy(), p.cpu().numpy(), y.numpy()], 1))
    local = np.concatenate(local)
    chunks = [None] * dist.get_world_size()
    dist.all_gather_object(chunks, local)
    merged = np.concatenate(chunks)
    _, keep = np.unique(merged[:, 0], return_index=True)
    merged = merged[keep]
    return merged[:, 1], merged[:, 2]


def main():
    parser = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(parser.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    is_main = rank == 0

    df = pd.read_parquet(cfg.data)
    df["month"] = pd.to_datetime(df["snapshot_date"]).dt.strftime("%Y-%m")
    tr = df[df["month"] <= cfg.train_end]
    va = df[df["month"] == cfg.valid_month]
    te = df[df["month"] == cfg.test_month]

    cat_maps = {c: {v: i + 1 for i, v in enumerate(sorted(tr[c].dropna().unique()))} for c in CATEGORICAL}
    stats = {"mean": tr[NUMERIC].mean().values.astype(np.float32),
             "std": tr[NUMERIC].std().values.astype(np.float32) + 1e-6}
    train_ds, valid_ds, test_ds = ChurnData(tr, cat_maps, stats), ChurnData(va, cat_maps, stats), ChurnData(te, cat_maps, stats)
    if is_main:
        print(f"{cfg.data}: train {len(train_ds)} valid {len(valid_ds)} test {len(test_ds)} world {world}")

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size // world, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, sampler=DistributedSampler(valid_ds, shuffle=False))
    test_loader = DataLoader(test_ds, batch_size=4096, sampler=DistributedSampler(test_ds, shuffle=False))

    net = FTTransformer([len(cat_maps[c]) for c in CATEGORICAL], len(NUMERIC),
                        cfg.d_token, cfg.n_layers, cfg.n_heads, cfg.dropout).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    pos_weight = torch.tensor([(1 - tr[LABEL].mean()) / tr[LABEL].mean()], device=device).sqrt()
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(cfg.out_dir, exist_ok=True)
    best_path = os.path.join(cfg.out_dir, "model_best.pt")
    best_auc = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for _, x_cat, x_num, y in train_loader:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = criterion(model(x_cat, x_num), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += torch.stack([loss.detach().float() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(running)

        p_val, y_val = gather_scores(model, valid_loader, device)
        if is_main:
            auc = roc_auc_score(y_val, p_val)
            print(f"epoch {epoch:02d} train_loss {(running[0] / running[1]).item():.4f} valid_auc {auc:.4f}")
            if auc > best_auc:
                best_auc = auc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "cat_maps": cat_maps,
                            "stats": stats, "config": asdict(cfg)}, best_path)
        dist.barrier()

    # reload the best epoch for threshold selection and the test report
    state = torch.load(best_path)
    model.module.load_state_dict(state["model"])
    p_val, y_val = gather_scores(model, valid_loader, device)
    p_test, y_test = gather_scores(model, test_loader, device)
    if is_main:
        prec, rec, thr = precision_recall_curve(y_val, p_val)
        f1s = 2 * prec * rec / np.clip(prec + rec, 1e-9, None)
        threshold = float(thr[np.argmax(f1s[:-1])])
        report = {
            "best_epoch": int(state["epoch"]),
            "valid_auc": float(roc_auc_score(y_val, p_val)),
            "test_auc": float(roc_auc_score(y_test, p_test)),
            "threshold": threshold,
            "test_f1": float(f1_score(y_test, p_test >= threshold)),
        }
        print(json.dumps(report, indent=2))
        with open(os.path.join(cfg.out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
