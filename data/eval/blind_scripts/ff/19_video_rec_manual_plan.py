"""Video recommendation CTR model with a hand-written sharding plan.

plan.json maps each embedding table to the rank that owns it (written by the
capacity planner notebook). Multi-valued features (watch history, tags) are
mean-pooled by EmbeddingBag over fixed-width padded id lists. Pooled embeddings are exchanged with an
autograd-aware all_to_all; the MLPs are DDP.

torchrun --nproc_per_node=8 19_video_rec_manual_plan.py --data /nfs/video_rec/v3 --plan plans/8gpu.json
"""
import argparse
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TABLES = {
    "user": (120_000_000, ["user_id"]),
    "video": (35_000_000, ["video_id", "watch_history"]),
    "channel": (4_000_000, ["channel_id", "subscribed_channels"]),
    "tag": (1_000_000, ["video_tags"]),
    "locale": (600, ["user_locale"]),
}
FEATURES = [f for _, fs in TABLES.values() for f in fs]
# multi-valued features are truncated / right-padded to a fixed length; id 0 is padding everywhere
MAX_LEN = {"watch_history": 50, "subscribed_channels": 20, "video_tags": 10}
WIDTH = [MAX_LEN.get(f, 1) for f in FEATURES]
COL = np.cumsum([0] + WIDTH)


class VideoImpressions(Dataset):
    """rows pickled as (features: dict[str, list[int]], dense: list[float], label)"""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.rows = pickle.load(f)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        feats, dense, label = self.rows[i]
        ids = np.zeros(COL[-1], dtype=np.int64)
        for j, f in enumerate(FEATURES):
            v = feats[f][-WIDTH[j]:]
            ids[COL[j]:COL[j] + len(v)] = v
        return ids, np.asarray(dense, dtype=np.float32), np.float32(label)


class PlannedEmbeddings(nn.Module):
    def __init__(self, plan, dim, rank, world, device):
        super().__init__()
        self.dim, self.rank, self.world = dim, rank, world
        owner = {f: plan[t] for t, (_, fs) in TABLES.items() for f in fs}
        self.feats_of = [[j for j, f in enumerate(FEATURES) if owner[f] == r] for r in range(world)]
        self.table_of = {f: t for t, (_, fs) in TABLES.items() for f in fs}
        self.tables = nn.ModuleDict({
            t: nn.EmbeddingBag(rows, dim, mode="mean", sparse=True, padding_idx=0, device=device)
            for t, (rows, _) in TABLES.items() if plan[t] == rank
        })
        order = [j for js in self.feats_of for j in js]
        self.restore = [order.index(j) for j in range(len(FEATURES))]

    def forward(self, ids):
        b = ids.size(0)
        every = ids.new_empty(self.world * b, ids.size(1))
        dist.all_gather_into_tensor(every, ids.contiguous())
        mine = self.feats_of[self.rank]
        if mine:
            pooled = torch.stack(
                [self.tables[self.table_of[FEATURES[j]]](every[:, COL[j]:COL[j + 1]]) for j in mine], dim=1
            )
        else:
            pooled = torch.zeros(self.world * b, 0, self.dim, device=ids.device, requires_grad=self.training)
        outs = [pooled.new_empty(b, len(self.feats_of[r]), self.dim) for r in range(self.world)]
        outs = dnn.all_to_all(outs, list(pooled.split(b, dim=0)))
        return torch.cat(outs, dim=1)[:, self.restore]


class Tower(nn.Module):
    def __init__(self, n_feats, dim, n_dense):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(n_feats * dim + n_dense, 768), nn.ReLU(),
            nn.Linear(768, 256), nn.ReLU(),
            nn.Linear(256, 1),
        )

    def forward(self, emb, dense):
        return self.mlp(torch.cat([emb.flatten(1), dense], dim=1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--emb_lr", type=float, default=0.01)
    ap.add_argument("--ckpt_dir", default="/nfs/video_rec/ckpt")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.plan) as f:
        plan = json.load(f)
    assert max(plan.values()) < world, f"plan needs {max(plan.values()) + 1} ranks, have {world}"

    emb = PlannedEmbeddings(plan, args.dim, rank, world, device)
    tower = DDP(Tower(len(FEATURES), args.dim, n_dense=12).to(device), device_ids=[local_rank])
    emb_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=args.emb_lr) if len(emb.tables) else None
    opt = torch.optim.Adam(tower.parameters(), lr=args.lr)

    ckpt_path = os.path.join(args.ckpt_dir, "checkpoint.pt")
    start_epoch = 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        tower.module.load_state_dict(ckpt["tower"])
        opt.load_state_dict(ckpt["opt"])
        emb.load_state_dict(ckpt["emb"])
        if emb_opt is not None:
            emb_opt.load_state_dict(ckpt["emb_opt"])
        start_epoch = ckpt["epoch"] + 1

    train_ds = VideoImpressions(os.path.join(args.data, "train.pkl"))
    val_ds = VideoImpressions(os.path.join(args.data, "val.pkl"))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, drop_last=True,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=4)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        emb.train()
        tower.train()
        t0 = time.time()
        for it, (ids, dense, y) in enumerate(loader):
            ids, dense, y = (t.to(device, non_blocking=True) for t in (ids, dense, y))
            loss = F.binary_cross_entropy_with_logits(tower(emb(ids), dense), y)
            if emb_opt is not None:
                emb_opt.zero_grad()
            opt.zero_grad()
            loss.backward()
            if emb_opt is not None:
                emb_opt.step()
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        emb.eval()
        tower.eval()
        s = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, dense, y in val_loader:
                ids, dense, y = ids.to(device), dense.to(device), y.to(device)
                s[0] += F.binary_cross_entropy_with_logits(tower(emb(ids), dense), y, reduction="sum")
                s[1] += y.numel()
        dist.all_reduce(s)
        if rank == 0:
            print(f"epoch {epoch} val logloss {(s[0] / s[1]).item():.5f}", flush=True)

        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save({
            "tower": tower.module.state_dict(), "opt": opt.state_dict(),
            "emb": emb.state_dict(), "emb_opt": emb_opt.state_dict() if emb_opt is not None else None,
            "epoch": epoch,
        }, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
