# Home-credit style default prediction: entity embeddings for the categorical
# columns + MLP on the numeric ones. Converted from our Kaggle notebook.
#
#   torchrun --nproc_per_node=4 12_credit_default_embeddings.py
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CFG = {
    "train_path": "input/application_train.parquet",
    "target": "TARGET",
    "id_col": "SK_ID_CURR",
    "valid_frac": 0.1,
    "batch_size": 2048,          # per GPU
    "base_lr": 2e-3,             # for 1 GPU
    "epochs": 20,
    "dropout": 0.3,
    "seed": 2024,
    "out_dir": "models/credit_emb",
}


def emb_size(card):
    return min(50, (card + 1) // 2)


class EntityEmbNet(nn.Module):
    def __init__(self, cardinalities, n_num, dropout):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_size(c)) for c in cardinalities])
        emb_total = sum(emb_size(c) for c in cardinalities)
        self.emb_drop = nn.Dropout(0.1)
        self.num_norm = nn.LayerNorm(n_num)
        self.mlp = nn.Sequential(
            nn.Linear(emb_total + n_num, 512), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(512, 256), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(256, 1),
        )

    def forward(self, x_cat, x_num):
        e = torch.cat([emb(x_cat[:, i]) for i, emb in enumerate(self.embs)], dim=1)
        x = torch.cat([self.emb_drop(e), self.num_norm(x_num)], dim=1)
        return self.mlp(x).squeeze(1)


def prepare(df, cfg):
    num_cols = [c for c in df.columns if df[c].dtype.kind in "if" and c not in (cfg["target"], cfg["id_col"])]
    cat_cols = list(set(df.columns) - set(num_cols) - {cfg["target"], cfg["id_col"]})
    for c in cat_cols:
        df[c] = df[c].fillna("NA").astype("category").cat.codes.astype(np.int64)
    df[num_cols] = df[num_cols].replace([np.inf, -np.inf], np.nan)
    df[num_cols] = df[num_cols].fillna(df[num_cols].median())
    q = df[num_cols].quantile([0.01, 0.99])
    df[num_cols] = df[num_cols].clip(q.iloc[0], q.iloc[1], axis=1)
    df[num_cols] = (df[num_cols] - df[num_cols].mean()) / (df[num_cols].std() + 1e-6)
    cards = [int(df[c].max()) + 1 for c in cat_cols]
    return df, cat_cols, num_cols, cards


def to_tensors(df, cat_cols, num_cols, target):
    return TensorDataset(torch.tensor(df[cat_cols].values, dtype=torch.long),
                         torch.tensor(df[num_cols].values, dtype=torch.float32),
                         torch.tensor(df[target].values, dtype=torch.float32))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(CFG["seed"])

    df = pd.read_parquet(CFG["train_path"])
    df, cat_cols, num_cols, cards = prepare(df, CFG)
    valid = df.sample(frac=CFG["valid_frac"], random_state=CFG["seed"])
    train = df.drop(valid.index)
    train_ds = to_tensors(train, cat_cols, num_cols, CFG["target"])
    valid_ds = to_tensors(valid, cat_cols, num_cols, CFG["target"])
    if rank == 0:
        print(f"{len(cat_cols)} categorical, {len(num_cols)} numeric columns; "
              f"train {len(train_ds)} valid {len(valid_ds)}")

    sampler = DistributedSampler(train_ds, shuffle=True, seed=CFG["seed"])
    train_dl = DataLoader(train_ds, batch_size=CFG["batch_size"], sampler=sampler, drop_last=True,
                          num_workers=2, pin_memory=True)
    valid_dl = DataLoader(valid_ds, batch_size=8192, shuffle=False)

    model = EntityEmbNet(cards, len(num_cols), CFG["dropout"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    pos_weight = torch.tensor([(1 - train[CFG["target"]].mean()) / train[CFG["target"]].mean()], device=device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    lr = CFG["base_lr"] * world
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=CFG["epochs"] * len(train_dl))

    best_auc = 0.0
    os.makedirs(CFG["out_dir"], exist_ok=True)
    for epoch in range(CFG["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x_cat, x_num, y in train_dl:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            loss = criterion(model(x_cat, x_num), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(loss_acc)

        if rank == 0:
            model.eval()
            preds = []
            with torch.no_grad():
                for x_cat, x_num, _ in valid_dl:
                    preds.append(torch.sigmoid(model.module(x_cat.to(device), x_num.to(device))).cpu())
            auc = roc_auc_score(valid[CFG["target"]].values, torch.cat(preds).numpy())
            print(f"epoch {epoch:02d}  train_loss {(loss_acc[0] / loss_acc[1]).item():.4f}  "
                  f"valid_auc {auc:.5f}  {time.time() - t0:.1f}s")
            if auc > best_auc:
                best_auc = auc
                torch.save({"state_dict": model.module.state_dict(), "cat_cols": cat_cols,
                            "num_cols": num_cols, "cards": cards},
                           os.path.join(CFG["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
