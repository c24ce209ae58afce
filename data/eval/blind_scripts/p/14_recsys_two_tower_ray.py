"""Two-tower retrieval model (user tower / item tower, in-batch softmax) on Ray Train.

After training, the driver reloads the best checkpoint and exports item embeddings
for the ANN index.

    python 14_recsys_two_tower_ray.py --interactions /mnt/shared/recs/clicks.parquet --num-workers 4
"""
import argparse
import os
import tempfile

import numpy as np
import pandas as pd
import ray
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


class Tower(nn.Module):
    def __init__(self, n_ids, n_feats, dim=64, hidden=256):
        super().__init__()
        self.id_emb = nn.Embedding(n_ids, dim)
        self.mlp = nn.Sequential(nn.Linear(dim + n_feats, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, ids, feats):
        return F.normalize(self.mlp(torch.cat([self.id_emb(ids), feats], -1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_user_feats, n_item_feats, dim=64, temperature=0.05):
        super().__init__()
        self.user = Tower(n_users, n_user_feats, dim)
        self.item = Tower(n_items, n_item_feats, dim)
        self.t = temperature

    def forward(self, uid, ufeat, iid, ifeat):
        u = self.user(uid, ufeat)
        v = self.item(iid, ifeat)
        return u @ v.T / self.t


def train_loop_per_worker(config):
    ctx = ray.train.get_context()
    model = TwoTower(config["n_users"], config["n_items"], config["n_user_feats"], config["n_item_feats"],
                     dim=config["dim"])
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"] * ctx.get_world_size())
    device = ray.train.torch.get_device()

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    bs = config["batch_size"]

    for epoch in range(config["epochs"]):
        model.train()
        tot, n = 0.0, 0
        for batch in train_shard.iter_torch_batches(batch_size=bs, device=device, drop_last=True,
                                                    local_shuffle_buffer_size=bs * 20):
            logits = model(batch["user_idx"], batch["user_feats"], batch["item_idx"], batch["item_feats"])
            labels = torch.arange(logits.size(0), device=device)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item(); n += 1

        model.eval()
        hits, cnt = 0.0, 0
        with torch.no_grad():
            for batch in val_shard.iter_torch_batches(batch_size=1024, device=device, drop_last=True):
                logits = model(batch["user_idx"], batch["user_feats"], batch["item_idx"], batch["item_feats"])
                top = logits.topk(10, dim=1).indices
                hits += (top == torch.arange(logits.size(0), device=device)[:, None]).any(1).float().sum().item()
                cnt += logits.size(0)
        metrics = {"epoch": epoch, "train_loss": tot / max(n, 1), "val_inbatch_hr10": hits / max(cnt, 1)}

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch, "config": config},
                           os.path.join(tmp, "model.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def build_features(path):
    df = pd.read_parquet(path)
    df["user_idx"] = df["user_id"].astype("category").cat.codes.astype(np.int64)
    df["item_idx"] = df["item_id"].astype("category").cat.codes.astype(np.int64)
    ucols = [c for c in df.columns if c.startswith("u_")]
    icols = [c for c in df.columns if c.startswith("i_")]
    df["user_feats"] = list(df[ucols].astype(np.float32).values)
    df["item_feats"] = list(df[icols].astype(np.float32).values)
    items = df.drop_duplicates("item_idx").sort_values("item_idx")
    return df, items, len(ucols), len(icols)


def export_item_embeddings(checkpoint, items, meta, out_path):
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "model.pt"), map_location="cpu")
    cfg = state["config"]
    model = TwoTower(meta["n_users"], meta["n_items"], meta["n_user_feats"], meta["n_item_feats"], dim=cfg["dim"])
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(items["item_idx"].values)
        feats = torch.tensor(np.stack(items["item_feats"].values))
        emb = torch.cat([model.item(ids[i:i + 8192], feats[i:i + 8192]) for i in range(0, len(ids), 8192)])
    np.save(out_path, emb.numpy())
    print(f"wrote {emb.shape} item embeddings to {out_path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--interactions", default="data/clicks.parquet")
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--storage", default="/mnt/shared/ray_results")
    ap.add_argument("--export", default="item_emb.npy")
    args = ap.parse_args()

    ray.init()
    df, items, n_uf, n_if = build_features(args.interactions)
    df = df.sample(frac=1.0, random_state=0)
    cut = int(0.95 * len(df))
    cols = ["user_idx", "user_feats", "item_idx", "item_feats"]
    train_ds = ray.data.from_pandas(df.iloc[:cut][cols])
    val_ds = ray.data.from_pandas(df.iloc[cut:][cols])
    meta = {"n_users": int(df["user_idx"].max() + 1), "n_items": int(df["item_idx"].max() + 1),
            "n_user_feats": n_uf, "n_item_feats": n_if}

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**meta, "dim": 64, "lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=True),
        datasets={"train": train_ds, "val": val_ds},
        run_config=RunConfig(name="two_tower", storage_path=args.storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2,
                                                                checkpoint_score_attribute="val_inbatch_hr10",
                                                                checkpoint_score_order="max")),
    )
    result = trainer.fit()
    print("final metrics:", result.metrics)
    best_ckpt, _ = max(result.best_checkpoints, key=lambda c: c[1]["val_inbatch_hr10"])
    export_item_embeddings(best_ckpt, items, meta, args.export)


if __name__ == "__main__":
    main()
