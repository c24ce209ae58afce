"""Hybrid-parallel DLRM with multi-hot (jagged) sparse features.

Embedding tables are placed table-wise on ranks (feature f lives on rank f % world);
the dense arch is data parallel. Per step:
  1. all_to_all of lengths, then of ids, so each table owner gets its feature for the
     whole global batch,
  2. pooled lookups on the owner,
  3. all_to_all of pooled embeddings back to the rank that owns each sample.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
    07_hybrid_jagged_a2a.py --train /lake/rec/jagged/day_{0..5}.npz --valid /lake/rec/jagged/day_6.npz
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class JaggedDay(Dataset):
    """Item i is batch i: dense [B,13], lengths [F,B], values (ids in feature order), label [B]."""

    def __init__(self, path, batch_size, num_features):
        z = np.load(path)
        self.dense, self.label = z["dense"], z["label"]
        self.offsets = [z[f"f{f}_offsets"] for f in range(num_features)]
        self.values = [z[f"f{f}_values"] for f in range(num_features)]
        self.bs = batch_size

    def __len__(self):
        return len(self.label) // self.bs

    def __getitem__(self, i):
        s, e = i * self.bs, (i + 1) * self.bs
        lengths = np.stack([np.diff(off[s:e + 1]) for off in self.offsets])
        values = np.concatenate([val[off[s]:off[e]] for off, val in zip(self.offsets, self.values)])
        dense = np.log1p(np.maximum(self.dense[s:e], 0)).astype(np.float32)
        return (torch.from_numpy(dense), torch.from_numpy(lengths.astype(np.int64)),
                torch.from_numpy(values.astype(np.int64)),
                torch.from_numpy(self.label[s:e].astype(np.float32)))


class TablewiseShardedEmbeddings(nn.Module):
    def __init__(self, num_features, rows, dim, rank, world):
        super().__init__()
        assert num_features >= world, "need at least one table per rank"
        self.rows, self.dim, self.rank, self.world = rows, dim, rank, world
        self.feats_of = [[f for f in range(num_features) if f % world == r] for r in range(world)]
        self.local_feats = self.feats_of[rank]
        self.send_order = [f for r in range(world) for f in self.feats_of[r]]
        self.register_buffer("inv_order", torch.tensor(np.argsort(self.send_order)), persistent=False)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in self.local_feats)
        for t in self.tables:
            nn.init.uniform_(t.weight, -0.05, 0.05)

    def forward(self, lengths, values):
        world, n_local, dim = self.world, len(self.local_feats), self.dim
        B = lengths.shape[1]
        counts = lengths.sum(1).tolist()
        per_feat = torch.split(values, counts)

        # 1) lengths: we send |feats_of[r]| * B to r and get n_local * B from everyone
        send_len = lengths[self.send_order].reshape(-1)
        len_in = [len(self.feats_of[r]) * B for r in range(world)]
        len_out = [n_local * B] * world
        recv_len = send_len.new_empty(sum(len_out))
        dist.all_to_all_single(recv_len, send_len, len_out, len_in)
        recv_len = recv_len.view(world, n_local, B)

        # 2) ids: the receive sizes follow from the lengths we just got
        send_val = torch.cat([per_feat[f] for f in self.send_order])
        val_in = [sum(counts[f] for f in self.feats_of[r]) for r in range(world)]
        per_src_feat = recv_len.sum(2)
        val_out = per_src_feat.sum(1).tolist()
        recv_val = send_val.new_empty(sum(val_out))
        dist.all_to_all_single(recv_val, send_val, val_out, val_in)
        chunks = torch.split(recv_val, per_src_feat.reshape(-1).tolist())

        pooled = []
        for j, table in enumerate(self.tables):
            ids = torch.cat([chunks[s * n_local + j] for s in range(world)])
            lens = recv_len[:, j, :].reshape(-1)
            offsets = torch.cumsum(lens, 0) - lens
            pooled.append(table(ids % self.rows, offsets))           # [world*B, D]

        # 3) pooled embeddings back to the sample owners (autograd-aware all_to_all)
        send_emb = torch.stack(pooled, 1).reshape(-1)
        emb_in = [B * n_local * dim] * world
        emb_out = [B * len(self.feats_of[r]) * dim for r in range(world)]
        recv_emb = dist_nn.all_to_all_single(send_emb.new_empty(sum(emb_out)), send_emb,
                                             emb_out, emb_in)
        if recv_emb.requires_grad:
            # every rank's loss is a mean over its local batch; average the sparse grads the
            # same way DDP averages the dense ones
            recv_emb.register_hook(lambda g: g / world)
        parts = torch.split(recv_emb, emb_out)
        emb = torch.cat([p.view(B, len(self.feats_of[r]), dim) for r, p in enumerate(parts)], 1)
        return emb[:, self.inv_order]


class DenseArch(nn.Module):
    def __init__(self, num_features, dim, bottom, top):
        super().__init__()
        def mlp(sizes, last_relu):
            layers = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if last_relu or i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            return nn.Sequential(*layers)
        self.bottom = mlp([13, *bottom, dim], True)
        n = num_features + 1
        self.top = mlp([dim + n * (n - 1) // 2, *top, 1], False)
        li, lj = torch.tril_indices(n, n, -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, emb):
        x = self.bottom(dense)
        t = torch.cat([x.unsqueeze(1), emb], 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


@torch.no_grad()
def evaluate(sparse, dense_arch, ds, rank, world, device, bins=10000):
    sparse.eval(); dense_arch.eval()
    hist = torch.zeros(2, bins, dtype=torch.float64, device=device)
    ll = torch.zeros(2, dtype=torch.float64, device=device)
    n_steps = len(ds) // world                      # same count on every rank
    for k in range(n_steps):
        d, lengths, values, y = (t.to(device) for t in ds[k * world + rank])
        logit = dense_arch(d, sparse(lengths, values))
        ll[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        ll[1] += y.numel()
        b = (torch.sigmoid(logit) * bins).long().clamp_(max=bins - 1)
        hist[0] += torch.bincount(b, weights=y.double(), minlength=bins)
        hist[1] += torch.bincount(b, weights=1.0 - y.double(), minlength=bins)
    dist.all_reduce(hist)
    dist.all_reduce(ll)
    sparse.train(); dense_arch.train()
    pos, neg = hist[0], hist[1]
    auc = (pos * (torch.cumsum(neg, 0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())
    return (ll[0] / ll[1]).item(), auc.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--num_features", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=2048, help="per rank")
    ap.add_argument("--dense_lr", type=float, default=1e-3)
    ap.add_argument("--sparse_lr", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--ckpt", default="/lake/rec/ckpt/hybrid_jagged")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)
    dense_arch = DDP(DenseArch(args.num_features, args.dim, [512, 256], [1024, 512, 256]).to(device),
                     device_ids=[local_rank])
    # tables differ per rank anyway, so give each shard its own init stream
    torch.manual_seed(args.seed + 1000 * (rank + 1))
    sparse = TablewiseShardedEmbeddings(args.num_features, args.rows, args.dim, rank, world).to(device)
    dense_opt = torch.optim.Adam(dense_arch.parameters(), lr=args.dense_lr)
    sparse_opt = torch.optim.Adagrad(sparse.parameters(), lr=args.sparse_lr)

    start_epoch = 0
    if args.resume:
        with open(os.path.join(args.ckpt, "meta.json")) as f:
            meta = json.load(f)
        if meta["world_size"] != world:
            raise RuntimeError(f"checkpoint has {meta['world_size']} table shards, job has {world}")
        dstate = torch.load(os.path.join(args.ckpt, "dense.pt"), map_location=device)
        dense_arch.module.load_state_dict(dstate["model"])
        dense_opt.load_state_dict(dstate["opt"])
        sstate = torch.load(os.path.join(args.ckpt, f"sparse_{rank}_of_{world}.pt"), map_location=device)
        sparse.load_state_dict(sstate["model"])
        sparse_opt.load_state_dict(sstate["opt"])
        start_epoch = meta["epoch"] + 1

    train_ds = ConcatDataset([JaggedDay(p, args.batch_size, args.num_features) for p in args.train])
    valid_ds = JaggedDay(args.valid, args.batch_size, args.num_features)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=None, sampler=sampler, num_workers=6, pin_memory=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (d, lengths, values, y) in enumerate(loader):
            d, lengths, values, y = (t.to(device, non_blocking=True) for t in (d, lengths, values, y))
            logit = dense_arch(d, sparse(lengths, values))
            loss = F.binary_cross_entropy_with_logits(logit, y)
            dense_opt.zero_grad(set_to_none=True)
            sparse_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"{(step + 1) * args.batch_size * world / (time.time() - t0):.0f} ex/s",
                      flush=True)

        logloss, auc = evaluate(sparse, dense_arch.module, valid_ds, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} valid logloss {logloss:.5f} auc {auc:.5f}", flush=True)
            os.makedirs(args.ckpt, exist_ok=True)
        dist.barrier()
        # each rank writes only its own table shard; rank 0 also writes the dense part
        torch.save({"model": sparse.state_dict(), "opt": sparse_opt.state_dict(),
                    "features": sparse.local_feats},
                   os.path.join(args.ckpt, f"sparse_{rank}_of_{world}.pt"))
        if rank == 0:
            torch.save({"model": dense_arch.module.state_dict(), "opt": dense_opt.state_dict()},
                       os.path.join(args.ckpt, "dense.pt"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(args.ckpt, "meta.json"), "w") as f:
                json.dump({"epoch": epoch, "world_size": world, "auc": auc, "logloss": logloss}, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
