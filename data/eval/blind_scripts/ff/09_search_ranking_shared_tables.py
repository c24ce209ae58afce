"""Search ranking model with shared embedding tables (TorchRec + DMP).

Several features look up the same table (e.g. the item id of the candidate and
the item ids in the user's history), so tables and features are declared
separately and tied through FEATURE_TABLE.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
    09_search_ranking_shared_tables.py --train /lake/search/train.parquet --val /lake/search/val.parquet
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

TABLE_ROWS = {
    "user": 80_000_000,
    "item": 25_000_000,
    "term": 3_000_000,
    "category": 30_000,
    "seller": 1_500_000,
}
FEATURE_TABLE = {
    "user_id": "user",
    "item_id": "item",
    "hist_item_ids": "item",
    "query_terms": "term",
    "title_terms": "term",
    "item_category": "category",
    "hist_categories": "category",
    "seller_id": "seller",
}
LIST_FEATURES = {"hist_item_ids", "query_terms", "title_terms", "hist_categories"}
DENSE_COLS = ["price_log", "ctr_7d", "ctr_30d", "position", "query_len", "item_age_days"]


class SearchLog(Dataset):
    def __init__(self, path, features):
        self.features = features
        df = pd.read_parquet(path, columns=features + DENSE_COLS + ["label"])
        self.cols = {f: df[f].to_numpy() for f in features}
        self.dense = df[DENSE_COLS].to_numpy(dtype=np.float32)
        self.labels = df["label"].to_numpy(dtype=np.float32)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {f: self.cols[f][i] for f in self.features}, self.dense[i], self.labels[i]


class Collate:
    def __init__(self, features):
        self.features = features

    def __call__(self, rows):
        values, lengths = [], []
        for f in self.features:
            for sparse, _, _ in rows:
                v = np.atleast_1d(np.asarray(sparse[f], dtype=np.int64))
                values.append(v)
                lengths.append(len(v))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.features,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.tensor(lengths, dtype=torch.int32),
        )
        dense = torch.from_numpy(np.stack([r[1] for r in rows]))
        labels = torch.from_numpy(np.array([r[2] for r in rows]))
        return dense, kjt, labels


def build_tables(dim):
    tables = []
    for table in {t for t in FEATURE_TABLE.values()}:
        feats = [f for f, t in FEATURE_TABLE.items() if t == table]
        tables.append(
            EmbeddingBagConfig(
                name=table,
                embedding_dim=dim,
                num_embeddings=TABLE_ROWS[table],
                feature_names=feats,
                pooling=PoolingType.MEAN if any(f in LIST_FEATURES for f in feats) else PoolingType.SUM,
            )
        )
    return tables


class Ranker(nn.Module):
    def __init__(self, tables, dim, device):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        n_feats = sum(len(t.feature_names) for t in tables)
        self.dense_norm = nn.LayerNorm(len(DENSE_COLS), device=device)
        self.mlp = nn.Sequential(
            nn.Linear(n_feats * dim + len(DENSE_COLS), 1024), nn.ReLU(),
            nn.Linear(1024, 512), nn.ReLU(),
            nn.Linear(512, 128), nn.ReLU(),
            nn.Linear(128, 1),
        ).to(device)

    def forward(self, dense, kjt):
        pooled = self.ebc(kjt).values()
        return self.mlp(torch.cat([pooled, self.dense_norm(dense)], dim=1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--emb_lr", type=float, default=0.03)
    ap.add_argument("--ckpt_dir", default="/lake/ckpt/search_ranker")
    ap.add_argument("--tb", default="/lake/tb/search_ranker")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tables = build_tables(args.dim)
    features = [f for t in tables for f in t.feature_names]
    model = Ranker(tables, args.dim, device)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=get_local_size(), compute_device="cuda"),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=device, plan=plan)
    optimizer = CombinedOptimizer([
        model.fused_optimizer,
        KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                              lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=1e-4)),
    ])

    collate = Collate(features)
    train_ds, val_ds = SearchLog(args.train, features), SearchLog(args.val, features)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              collate_fn=collate, num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, drop_last=True, collate_fn=collate,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=6, pin_memory=True)
    writer = SummaryWriter(args.tb) if rank == 0 else None

    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for dense, kjt, labels in train_loader:
            dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
            loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1
            if writer and global_step % 100 == 0:
                writer.add_scalar("loss/train", loss.item(), global_step)
                writer.add_scalar("perf/samples_per_s",
                                  100 * args.batch_size * world / (time.time() - t0), global_step)
                t0 = time.time()

        model.eval()
        auroc = BinaryAUROC().to(device)
        with torch.no_grad():
            for dense, kjt, labels in val_loader:
                logits = model(dense.to(device), kjt.to(device))
                auroc.update(torch.sigmoid(logits), labels.to(device).long())
        auc = auroc.compute().item()
        if writer:
            writer.add_scalar("auc/val", auc, global_step)
            print(f"epoch {epoch}: val auc {auc:.4f}", flush=True)

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt_dir, f"epoch{epoch}"))

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
