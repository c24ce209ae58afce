"""Ranking model with user behaviour sequences and model-parallel embedding tables.

Sparse features are bags of ids (single-valued features are bags of length 1, behaviour
sequences have up to 100 ids). Tables are too big to replicate, so table t is stored only
on rank `t % world_size`; the MLPs are replicated with DDP.

    torchrun --nproc_per_node=8 13_mp_embedding_behavior_seq.py --window 20240801-20240814
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single as a2a_autograd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FEATURES = ["user_id", "item_id", "shop_id", "brand_id", "cate_id", "hist_item_ids",
            "hist_cate_ids", "hist_shop_ids", "query_terms", "user_tags", "geo_cell", "device"]
TABLE_ROWS = [20_000_000, 8_000_000, 1_000_000, 500_000, 20_000, 8_000_000,
              20_000, 1_000_000, 2_000_000, 100_000, 500_000, 5_000]


class BagBatches(Dataset):
    """CSR columns saved as .npy files in one directory per day (or window).

    Item k is (dense, lengths[F,B], ids, label) of batch k.
    """

    def __init__(self, path, batch_size):
        names = ["dense", "label"] + [f"{f}.{part}" for f in FEATURES for part in ("offsets", "ids")]
        self.z = {n: np.load(os.path.join(path, f"{n}.npy"), mmap_mode="r") for n in names}
        self.n = len(self.z["label"]) // batch_size
        self.bs = batch_size

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        s, e = k * self.bs, (k + 1) * self.bs
        lens, ids = [], []
        for f in FEATURES:
            off = self.z[f"{f}.offsets"]
            lens.append(np.diff(off[s:e + 1]))
            ids.append(self.z[f"{f}.ids"][off[s]:off[e]])
        return (torch.from_numpy(np.asarray(self.z["dense"][s:e], dtype=np.float32)),
                torch.from_numpy(np.stack(lens).astype(np.int64)),
                torch.from_numpy(np.concatenate(ids).astype(np.int64)),
                torch.from_numpy(np.asarray(self.z["label"][s:e], dtype=np.float32)))


class ModelParallelEmbeddings(nn.Module):
    def __init__(self, rows, dim, rank, world):
        super().__init__()
        self.world, self.dim = world, dim
        self.owner = [t % world for t in range(len(rows))]
        self.owned = [[t for t in range(len(rows)) if self.owner[t] == r] for r in range(world)]
        self.mine = self.owned[rank]
        self.rows = [rows[t] for t in self.mine]
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="mean", sparse=True) for n in self.rows)
        for b in self.bags:
            nn.init.normal_(b.weight, std=0.01)
        order = [t for r in range(world) for t in self.owned[r]]
        self.register_buffer("unpermute", torch.as_tensor(np.argsort(order)), persistent=False)
        self.order = order

    def forward(self, lengths, ids):
        W, D, n_mine = self.world, self.dim, len(self.mine)
        B = lengths.size(1)
        per_table = torch.split(ids, lengths.sum(1).tolist())

        # lengths: fixed size per peer
        send_len = lengths[self.order].flatten()
        len_splits_in = [len(self.owned[r]) * B for r in range(W)]
        recv_len = send_len.new_empty(n_mine * B * W)
        dist.all_to_all_single(recv_len, send_len, [n_mine * B] * W, len_splits_in)
        recv_len = recv_len.view(W, n_mine, B)

        # ids
        send_ids = torch.cat([per_table[t] for t in self.order])
        send_splits = [int(sum(per_table[t].numel() for t in self.owned[r])) for r in range(W)]
        recv_ids = torch.empty_like(send_ids)
        dist.all_to_all_single(recv_ids, send_ids, send_splits, send_splits)
        pieces = torch.split(recv_ids, recv_len.sum(2).flatten().tolist())

        pooled = []
        for j, bag in enumerate(self.bags):
            bag_ids = torch.cat([pieces[src * n_mine + j] for src in range(W)])
            bag_len = recv_len[:, j].reshape(-1)
            offsets = F.pad(torch.cumsum(bag_len, 0)[:-1], (1, 0))
            pooled.append(bag(bag_ids % self.rows[j], offsets))

        out = torch.stack(pooled, 1).reshape(-1)                      # [W*B, n_mine, D]
        splits_back = [B * len(self.owned[r]) * D for r in range(W)]
        emb = a2a_autograd(out.new_empty(sum(splits_back)), out, splits_back, [B * n_mine * D] * W)
        if emb.requires_grad:
            emb.register_hook(lambda g: g / W)
        emb = torch.cat([c.view(B, -1, D) for c in torch.split(emb, splits_back)], 1)
        return emb[:, self.unpermute]


class RankingHead(nn.Module):
    def __init__(self, n_feat, dim, n_dense=8, hidden=(1024, 512, 256)):
        super().__init__()
        self.dense_proj = nn.Sequential(nn.Linear(n_dense, dim), nn.ReLU())
        layers, d = [], (n_feat + 1) * dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.mlp = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, dense, emb):
        x = torch.cat([self.dense_proj(dense), emb.flatten(1)], 1)
        return self.mlp(x).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/cfs/rank/bagged")
    ap.add_argument("--window", default="20240801-20240814")
    ap.add_argument("--eval_day", default="20240815")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dense_lr", type=float, default=1e-3)
    ap.add_argument("--sparse_lr", type=float, default=1e-3)
    ap.add_argument("--save_dir", default="/cfs/rank/ckpt/behavior_seq")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train = BagBatches(os.path.join(args.data_root, args.window), args.batch)
    valid = BagBatches(os.path.join(args.data_root, args.eval_day), args.batch)
    sampler = DistributedSampler(train, shuffle=True, seed=3, drop_last=True)
    loader = DataLoader(train, batch_size=None, sampler=sampler, num_workers=6, pin_memory=True)

    torch.manual_seed(3)
    head = DDP(RankingHead(len(FEATURES), args.dim).to(dev), device_ids=[local_rank])
    torch.manual_seed(3 + rank)
    emb = ModelParallelEmbeddings(TABLE_ROWS, args.dim, rank, world).to(dev)
    dense_opt = torch.optim.AdamW(head.parameters(), lr=args.dense_lr, weight_decay=1e-5)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=args.sparse_lr)

    sampler.set_epoch(0)
    t0 = time.time()
    for step, batch in enumerate(loader):
        dense, lengths, ids, y = (t.to(dev, non_blocking=True) for t in batch)
        logit = head(dense, emb(lengths, ids))
        loss = F.binary_cross_entropy_with_logits(logit, y)
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        if step % 200 == 0 and rank == 0:
            print(f"step {step}/{len(loader)} loss {loss.item():.4f} "
                  f"{(step + 1) * args.batch * world / (time.time() - t0):.0f} samples/s", flush=True)

    # evaluation: same number of batches on every rank (the all_to_alls need all ranks)
    head.eval(); emb.eval()
    nb = 2048
    hist = torch.zeros(2, nb, dtype=torch.float64, device=dev)
    ll = torch.zeros(2, dtype=torch.float64, device=dev)
    with torch.no_grad():
        for k in range(len(valid) // world):
            dense, lengths, ids, y = (t.to(dev) for t in valid[k * world + rank])
            logit = head.module(dense, emb(lengths, ids))
            ll += torch.stack([F.binary_cross_entropy_with_logits(logit, y, reduction="sum").double(),
                               torch.tensor(float(y.numel()), dtype=torch.float64, device=dev)])
            b = (torch.sigmoid(logit) * nb).long().clamp(max=nb - 1)
            hist[0] += torch.bincount(b, weights=y.double(), minlength=nb)
            hist[1] += torch.bincount(b, weights=1 - y.double(), minlength=nb)
    dist.all_reduce(hist)
    dist.all_reduce(ll)
    pos, neg = hist
    auc = ((pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    if rank == 0:
        print(f"eval {args.eval_day}: auc {auc:.5f} logloss {(ll[0] / ll[1]).item():.5f}", flush=True)
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(head.module.state_dict(), os.path.join(args.save_dir, "head.pt"))
    dist.barrier()
    torch.save({"tables": emb.mine, "state": emb.state_dict()},
               os.path.join(args.save_dir, f"tables_rank{rank}_of{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
