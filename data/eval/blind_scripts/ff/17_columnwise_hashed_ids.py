"""Column-wise sharded embeddings (each GPU holds a slice of every table's
dimensions) for a CTR model trained on feature-store exports.

Ids in the export are raw 64-bit feature hashes; they are folded into the
table with a modulo in the dataset. Per-feature table sizes can be given in a
JSON file (tuned for the memory budget); without it every table gets
--hash_size rows.

torchrun --nproc_per_node=8 17_columnwise_hashed_ids.py \
    --data /fs/exports/ctr_v5 --table_sizes configs/ctr_v5_table_sizes.json
"""
import argparse
import json
import os
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
from torch.utils.tensorboard import SummaryWriter

FEATURES = ["user", "item", "shop", "brand", "cate", "query", "city", "device", "hour", "network",
            "ad_slot", "campaign"]


class HashedExport(Dataset):
    def __init__(self, root, split, hash_size):
        self.hashes = np.load(os.path.join(root, f"{split}_hashes.npy"), mmap_mode="r")  # uint64 [N, F]
        self.dense = np.load(os.path.join(root, f"{split}_dense.npy"), mmap_mode="r")
        self.labels = np.load(os.path.join(root, f"{split}_labels.npy"), mmap_mode="r")
        self.hash_size = hash_size

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = (np.asarray(self.hashes[i], dtype=np.uint64) % np.uint64(self.hash_size)).astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(np.asarray(self.dense[i], np.float32)), \
            torch.tensor(float(self.labels[i]))


class ColumnWiseEmbeddings(nn.Module):
    def __init__(self, rows, dim, world, device):
        super().__init__()
        assert dim % world == 0, "embedding dim must split evenly over ranks"
        self.world, self.cols = world, dim // world
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(n, self.cols, mode="sum", sparse=True, device=device) for n in rows]
        )
        for t in self.tables:
            nn.init.uniform_(t.weight, -0.01, 0.01)

    def forward(self, ids):
        b, f = ids.shape
        all_ids = ids.new_empty(self.world * b, f)
        dist.all_gather_into_tensor(all_ids, ids.contiguous())
        local = torch.stack([t(all_ids[:, j:j + 1]) for j, t in enumerate(self.tables)], dim=1)
        if local.requires_grad:
            local.register_hook(lambda g: g / self.world)
        out = dnn.all_to_all_single(torch.empty_like(local), local.contiguous())
        # [world(col slice), b, f, cols] -> [b, f, world * cols]
        return out.view(self.world, b, f, self.cols).permute(1, 2, 0, 3).reshape(b, f, -1)


class CTRNet(nn.Module):
    def __init__(self, n_fields, dim, n_dense):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(n_dense, 64), nn.ReLU())
        self.net = nn.Sequential(
            nn.Linear(n_fields * dim + 64, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
            nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
            nn.Linear(512, 1),
        )

    def forward(self, emb, dense):
        return self.net(torch.cat([emb.flatten(1), self.dense(dense)], dim=1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--hash_size", type=int, default=20_000_000)
    ap.add_argument("--table_sizes", default=None)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--emb_lr", type=float, default=0.02)
    ap.add_argument("--out", default="/fs/ckpt/ctr_v5_cw")
    ap.add_argument("--tb", default="/fs/tb/ctr_v5_cw")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    if args.table_sizes:
        with open(args.table_sizes) as fh:
            sizes = json.load(fh)
        rows = [int(sizes.get(f, args.hash_size)) for f in FEATURES]
    else:
        rows = [args.hash_size] * len(FEATURES)

    emb = ColumnWiseEmbeddings(rows, args.dim, world, device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(CTRNet(len(FEATURES), args.dim, n_dense=16)).to(device)
    net = DDP(net, device_ids=[local_rank])
    emb_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=args.emb_lr)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)

    train_ds = HashedExport(args.data, "train", args.hash_size)
    val_ds = HashedExport(args.data, "val", args.hash_size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, drop_last=True, num_workers=6,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), pin_memory=True)
    tb = SummaryWriter(args.tb) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        emb.train()
        net.train()
        t0 = time.time()
        for ids, dense, y in loader:
            ids, dense, y = ids.to(device, non_blocking=True), dense.to(device, non_blocking=True), y.to(device)
            loss = F.binary_cross_entropy_with_logits(net(emb(ids), dense), y)
            emb_opt.zero_grad()
            opt.zero_grad()
            loss.backward()
            emb_opt.step()
            opt.step()
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/samples_per_sec", 100 * args.batch_size * world / (time.time() - t0), step)
                t0 = time.time()

        emb.eval()
        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, dense, y in val_loader:
                ids, dense, y = ids.to(device), dense.to(device), y.to(device)
                acc[0] += F.binary_cross_entropy_with_logits(net(emb(ids), dense), y, reduction="sum")
                acc[1] += y.numel()
        dist.all_reduce(acc)
        if tb is not None:
            tb.add_scalar("val/logloss", (acc[0] / acc[1]).item(), step)

        os.makedirs(args.out, exist_ok=True)
        torch.save(emb.state_dict(), os.path.join(args.out, f"emb_cols_rank{rank}_of{world}.pt"))
        if rank == 0:
            torch.save({"net": net.module.state_dict(), "rows": rows, "epoch": epoch},
                       os.path.join(args.out, "net.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
