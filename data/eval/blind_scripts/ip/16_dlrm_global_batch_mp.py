"""DLRM with model-parallel embeddings, in the style of the reference dlrm_s_pytorch.py.

Every rank reads the same global mini-batch. Sparse lookups for the tables a rank owns are
done for the whole global batch, then an all_to_all hands each rank the embeddings of its
slice of the batch; the MLPs run data parallel on that slice.

    torchrun --nproc_per_node=8 16_dlrm_global_batch_mp.py --global_batch 65536
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn_f
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

CARDINALITIES = [45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176,
                 345138, 10, 2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537,
                 452104, 12606, 104, 35]


class SameOrderSampler(Sampler):
    """Identical batch order on every rank (seeded per epoch)."""

    def __init__(self, n_batches, seed):
        self.n, self.seed, self.epoch = n_batches, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


class TerabyteBatches(Dataset):
    def __init__(self, prefix, global_batch, max_rows):
        self.x_int = np.load(prefix + "_dense.npy", mmap_mode="r")
        self.x_cat = np.load(prefix + "_sparse.npy", mmap_mode="r")
        self.y = np.load(prefix + "_label.npy", mmap_mode="r")
        self.gb = global_batch
        self.rows = np.array([min(c, max_rows) for c in CARDINALITIES], dtype=np.int64)

    def __len__(self):
        return len(self.y) // self.gb

    def __getitem__(self, k):
        s = slice(k * self.gb, (k + 1) * self.gb)
        dense = np.log1p(np.asarray(self.x_int[s], dtype=np.float32))
        cat = np.asarray(self.x_cat[s], dtype=np.int64) % self.rows
        return torch.from_numpy(dense), torch.from_numpy(cat), torch.from_numpy(np.asarray(self.y[s], np.float32))


class LocalTables(nn.Module):
    def __init__(self, rows, dim, rank, world):
        super().__init__()
        n = len(rows)
        self.rank, self.world, self.dim = rank, world, dim
        self.per_rank = [list(range(r, n, world)) for r in range(world)]
        self.mine = self.per_rank[rank]
        self.emb = nn.ModuleList(nn.EmbeddingBag(int(rows[t]), dim, mode="sum", sparse=True)
                                 for t in self.mine)
        for e in self.emb:
            bound = 1.0 / np.sqrt(e.num_embeddings)
            nn.init.uniform_(e.weight, -bound, bound)
        order = [t for r in range(world) for t in self.per_rank[r]]
        self.register_buffer("restore", torch.as_tensor(np.argsort(order)), persistent=False)

    def forward(self, cat_global):
        G = cat_global.size(0)
        B = G // self.world
        D = self.dim
        local = torch.stack([e(cat_global[:, t:t + 1]) for e, t in zip(self.emb, self.mine)], 1)
        send = local.reshape(-1)                               # [G, n_mine, D] by sample
        in_splits = [B * len(self.mine) * D] * self.world
        out_splits = [B * len(self.per_rank[r]) * D for r in range(self.world)]
        recv = dnn_f.all_to_all_single(send.new_empty(sum(out_splits)), send, out_splits, in_splits)
        if recv.requires_grad:
            recv.register_hook(lambda g: g / self.world)
        parts = [p.view(B, -1, D) for p in torch.split(recv, out_splits)]
        return torch.cat(parts, 1)[:, self.restore]


class DenseNet(nn.Module):
    def __init__(self, n_tables, dim, bot, top):
        super().__init__()
        bl, d = [], 13
        for h in bot + [dim]:
            bl += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.bot = nn.Sequential(*bl)
        f = n_tables + 1
        tl, d = [], dim + f * (f - 1) // 2
        for h in top:
            tl += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.top = nn.Sequential(*tl, nn.Linear(d, 1))
        li, lj = torch.tril_indices(f, f, -1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, emb):
        x = self.bot(dense)
        T = torch.cat([x.unsqueeze(1), emb], 1)
        Z = torch.bmm(T, T.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, Z], 1)).squeeze(1)


def my_slice(t, rank, world):
    B = t.size(0) // world
    return t[rank * B:(rank + 1) * B]


def save_checkpoint(path, step, dense, tables, dense_opt, sparse_opt):
    torch.save({"step": step,
                "dense": dense.module.state_dict(),
                "tables": tables.state_dict(),
                "table_ids": tables.mine,
                "dense_opt": dense_opt.state_dict(),
                "sparse_opt": sparse_opt.state_dict()}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_prefix", default="/mnt/terabyte/processed/train")
    ap.add_argument("--test_prefix", default="/mnt/terabyte/processed/test")
    ap.add_argument("--max_rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bot", default="512-256")
    ap.add_argument("--top", default="1024-1024-512-256")
    ap.add_argument("--global_batch", type=int, default=65536)
    ap.add_argument("--dense_lr", type=float, default=4e-3)
    ap.add_argument("--sparse_lr", type=float, default=4e-3)
    ap.add_argument("--ckpt_every", type=int, default=10000)
    ap.add_argument("--ckpt_dir", default="/mnt/terabyte/ckpt/dlrm_mp")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0

    train = TerabyteBatches(args.train_prefix, args.global_batch, args.max_rows)
    test = TerabyteBatches(args.test_prefix, args.global_batch, args.max_rows)
    sampler = SameOrderSampler(len(train), seed=1)
    loader = DataLoader(train, batch_size=None, sampler=sampler, num_workers=8, pin_memory=True)

    torch.manual_seed(1)
    dense = DDP(DenseNet(len(CARDINALITIES), args.dim, [int(x) for x in args.bot.split("-")],
                         [int(x) for x in args.top.split("-")]).to(dev), device_ids=[local_rank])
    tables = LocalTables(train.rows, args.dim, rank, world).to(dev)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=args.dense_lr)
    sparse_opt = torch.optim.SGD(tables.parameters(), lr=args.sparse_lr)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()

    sampler.set_epoch(0)
    step, t0 = 0, time.time()
    for dense_x, cat_x, y in loader:
        dense_x, cat_x, y = dense_x.to(dev, non_blocking=True), cat_x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        emb = tables(cat_x)
        logit = dense(my_slice(dense_x, rank, world), emb)
        loss = F.binary_cross_entropy_with_logits(logit, my_slice(y, rank, world))
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        step += 1
        if step % 1000 == 0 and rank == 0:
            print(f"step {step}/{len(loader)} loss {loss.item():.5f} "
                  f"{1000 * args.global_batch / (time.time() - t0):.0f} samples/s", flush=True)
            t0 = time.time()
        if step % args.ckpt_every == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, f"step_{step}.pt"), step, dense, tables,
                            dense_opt, sparse_opt)
            dist.barrier()

    dense.eval(); tables.eval()
    bins = 4096
    hist = torch.zeros(2, bins, dtype=torch.float64, device=dev)
    with torch.no_grad():
        for k in range(len(test)):
            dense_x, cat_x, y = (t.to(dev) for t in test[k])
            logit = dense.module(my_slice(dense_x, rank, world), tables(cat_x))
            yb = my_slice(y, rank, world).double()
            b = (torch.sigmoid(logit) * bins).long().clamp(max=bins - 1)
            hist[0] += torch.bincount(b, weights=yb, minlength=bins)
            hist[1] += torch.bincount(b, weights=1 - yb, minlength=bins)
    dist.all_reduce(hist)
    pos, neg = hist
    auc = ((pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    if rank == 0:
        print(f"test auc {auc:.5f} after {step} steps", flush=True)
    save_checkpoint(os.path.join(args.ckpt_dir, "final.pt"), step, dense, tables, dense_opt, sparse_opt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
