"""Behavior Sequence Transformer (BST) for CTR with TorchRec.

The user's click sequence and the target item share the item table through an
EmbeddingCollection (unpooled, per-id embeddings); user profile features go
through a pooled EmbeddingBagCollection. Both are sharded by DMP.

Usage:
    torchrun --nproc_per_node=8 12_bst_sequence_ec.py --train_dir /data/bst/train --val_dir /data/bst/val
"""
import argparse
import glob
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

PROFILE_FEATURES = {"user_id": 10_000_000, "gender": 3, "age_group": 10, "city": 4_000, "occupation": 64}
NUM_ITEMS = 6_000_000


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_dir", required=True)
    p.add_argument("--val_dir", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seq_len", type=int, default=20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emb_lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save_dir", default="/mnt/nas/bst_ckpt")
    return p.parse_args()


class BehaviorLogs(Dataset):
    """jsonl rows: {"profile": {...}, "hist": [item ids, oldest first], "target": id, "label": 0/1}"""

    def __init__(self, root, seq_len):
        self.rows = []
        for path in sorted(glob.glob(os.path.join(root, "*.jsonl"))):
            with open(path) as f:
                self.rows.extend(json.loads(line) for line in f)
        self.seq_len = seq_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["profile"], r["hist"][-self.seq_len:], r["target"], float(r["label"])


def collate(rows):
    b = len(rows)
    prof_vals = [r[0][k] for k in PROFILE_FEATURES for r in rows]
    profile = KeyedJaggedTensor.from_lengths_sync(
        keys=list(PROFILE_FEATURES),
        values=torch.tensor(prof_vals, dtype=torch.int64),
        lengths=torch.ones(len(prof_vals), dtype=torch.int32),
    )
    seq_vals = [i for r in rows for i in r[1]] + [r[2] for r in rows]
    seq_lens = [len(r[1]) for r in rows] + [1] * b
    items = KeyedJaggedTensor.from_lengths_sync(
        keys=["hist_items", "target_item"],
        values=torch.tensor(seq_vals, dtype=torch.int64),
        lengths=torch.tensor(seq_lens, dtype=torch.int32),
    )
    labels = torch.tensor([r[3] for r in rows])
    return profile, items, labels


class BST(nn.Module):
    def __init__(self, args, device):
        super().__init__()
        d = args.dim
        self.seq_len = args.seq_len
        self.items = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item", embedding_dim=d, num_embeddings=NUM_ITEMS,
                                    feature_names=["hist_items", "target_item"])],
            device=torch.device("meta"),
        )
        self.profile = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{k}", embedding_dim=d, num_embeddings=n, feature_names=[k])
                    for k, n in PROFILE_FEATURES.items()],
            device=torch.device("meta"),
        )
        self.pos = nn.Embedding(args.seq_len + 1, d, device=device)
        layer = nn.TransformerEncoderLayer(d, args.heads, dim_feedforward=4 * d, dropout=0.1,
                                           batch_first=True, device=device)
        self.encoder = nn.TransformerEncoder(layer, args.layers)
        in_dim = d * (args.seq_len + 1) + d * len(PROFILE_FEATURES)
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, 1024), nn.LeakyReLU(), nn.Linear(1024, 512), nn.LeakyReLU(),
            nn.Linear(512, 256), nn.LeakyReLU(), nn.Linear(256, 1),
        ).to(device)

    def forward(self, profile, items):
        seq = self.items(items)
        hist = seq["hist_items"].to_padded_dense(desired_length=self.seq_len)          # [B, L, d]
        target = seq["target_item"].to_padded_dense(desired_length=1)                 # [B, 1, d]
        lengths = seq["hist_items"].lengths()
        x = torch.cat([hist, target], dim=1) + self.pos.weight[None]
        pad = torch.arange(self.seq_len + 1, device=x.device)[None] >= lengths[:, None]
        pad[:, -1] = False
        h = self.encoder(x, src_key_padding_mask=pad)
        prof = self.profile(profile).values()
        return self.mlp(torch.cat([h.flatten(1), prof], dim=1)).squeeze(1)


def main():
    args = parse_args()
    device = torch.device(f"cuda:{args.local_rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    model = BST(args, device)
    apply_optimizer_in_backward(torch.optim.Adagrad,
                                list(model.items.parameters()) + list(model.profile.parameters()),
                                {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=get_local_size(), compute_device="cuda"),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=device, plan=plan)
    optimizer = CombinedOptimizer([
        model.fused_optimizer,
        KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                              lambda ps: torch.optim.Adam(ps, lr=args.lr)),
    ])

    train_ds, val_ds = BehaviorLogs(args.train_dir, args.seq_len), BehaviorLogs(args.val_dir, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              drop_last=True, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collate, drop_last=True,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=4, pin_memory=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for step, (profile, items, labels) in enumerate(train_loader):
            logits = model(profile.to(device), items.to(device))
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
            if rank == 0 and (step + 1) % 200 == 0:
                print(f"epoch {epoch} step {step + 1} loss {running / 200:.4f}", flush=True)
                running = 0.0

        model.eval()
        auroc = BinaryAUROC().to(device)
        with torch.no_grad():
            for profile, items, labels in val_loader:
                logits = model(profile.to(device), items.to(device))
                auroc.update(torch.sigmoid(logits), labels.to(device).long())
        auc = auroc.compute().item()
        if rank == 0:
            print(f"epoch {epoch} val auc {auc:.4f}", flush=True)

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.save_dir, f"epoch_{epoch}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
