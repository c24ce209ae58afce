"""Query-text x product-ID two-tower model trained with DeepSpeed ZeRO-3.

The product tower is a plain ID embedding table (30M products x 256), which is
what pushes this onto ZeRO-3: table + Adam state do not fit on one GPU.  The query
tower hashes word/char n-grams into an EmbeddingBag followed by an MLP.

Every epoch the product table is L2-normalised into an exact top-k "index" that
is used to mine hard negatives for the next epoch and to compute dev recall.

    deepspeed --num_gpus 8 15_ds_zero3_id_tower.py --data /fsx/search/id_tt --out /fsx/ckpt/id_tt
"""
import argparse
import os
import time
import zlib

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HASH_BUCKETS = 2_000_000


def featurize(q):
    q = q.lower()
    toks = [f"w{w}" for w in q.split()] + [f"c{q[i:i + 4]}" for i in range(max(1, len(q) - 3))]
    return [zlib.adler32(t.encode()) % HASH_BUCKETS for t in toks]


class QueryTower(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bag = nn.EmbeddingBag(HASH_BUCKETS, 128, mode="sum")
        self.mlp = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, dim))

    def forward(self, ids, offsets):
        return self.mlp(self.bag(ids, offsets))


class IdTwoTower(nn.Module):
    def __init__(self, n_items, dim):
        super().__init__()
        self.query_tower = QueryTower(dim)
        self.item_emb = nn.Embedding(n_items, dim)
        nn.init.normal_(self.item_emb.weight, std=0.02)

    def forward(self, ids, offsets, pos_items, neg_items):
        q = F.normalize(self.query_tower(ids, offsets), dim=-1)
        pos = F.normalize(self.item_emb(pos_items), dim=-1)
        neg = F.normalize(self.item_emb(neg_items), dim=-1)
        return q, pos, neg


class Interactions(Dataset):
    def __init__(self, q_feats, items, hard_negs, n_items, seed):
        self.q_feats, self.items, self.hard_negs, self.n_items = q_feats, items, hard_negs, n_items
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        cands = self.hard_negs.get(i)
        neg = int(self.rng.choice(cands)) if cands is not None and len(cands) else int(self.rng.integers(self.n_items))
        return self.q_feats[i], self.items[i], neg


def collate(batch):
    feats, pos, neg = zip(*batch)
    lengths = torch.tensor([len(f) for f in feats])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    ids = torch.tensor([t for f in feats for t in f], dtype=torch.long)
    return ids, offsets, torch.tensor(pos), torch.tensor(neg)


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.98]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 2000}},
        "steps_per_print": 500,
    }


@torch.no_grad()
def item_matrix(engine):
    w = engine.module.item_emb.weight
    return F.normalize(w.detach().to(torch.bfloat16), dim=-1)


@torch.no_grad()
def topk_items(engine, feats, items_mat, k, device, bs=2048):
    out = []
    for i in range(0, len(feats), bs):
        ids, offsets, _, _ = collate([(f, 0, 0) for f in feats[i:i + bs]])
        q = F.normalize(engine.module.query_tower(ids.to(device), offsets.to(device)), dim=-1)
        out.append((q.to(items_mat.dtype) @ items_mat.T).topk(k, dim=1).indices.cpu())
    return torch.cat(out) if out else torch.empty(0, k, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--micro_batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.05)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    train = pd.read_parquet(os.path.join(args.data, "train.parquet"), columns=["query", "item_idx"])
    dev = pd.read_parquet(os.path.join(args.data, "dev.parquet"), columns=["query", "item_idx"])
    n_items = int(np.load(os.path.join(args.data, "n_items.npy")))
    train_feats = [featurize(q) for q in train["query"]]
    train_items = train.item_idx.to_numpy()
    dev_feats = [featurize(q) for q in dev["query"]]
    dev_items = dev.item_idx.to_numpy()

    with deepspeed.zero.Init(config_dict_or_path=ds_config(args)):
        model = IdTwoTower(n_items, args.dim)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))

    hard_negs = {}
    ds = Interactions(train_feats, train_items, hard_negs, n_items, seed=1000 + rank)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)

    for epoch in range(args.epochs):
        t0 = time.time()
        engine.eval()
        items_mat = item_matrix(engine)
        # dev recall@100 on this rank's slice, summed over ranks
        my = np.arange(rank, len(dev_feats), world)
        per_rank = -(-len(dev_feats) // world)
        # pad so every rank runs the same number of query-tower batches
        feats = [dev_feats[i] for i in my] + [[0]] * (per_rank - len(my))
        top = topk_items(engine, feats, items_mat, 100, device)[: len(my)]
        hit = torch.tensor([sum(int(dev_items[i] in set(row.tolist())) for i, row in zip(my, top)), len(my)],
                           dtype=torch.float64, device=device)
        dist.all_reduce(hit)
        if rank == 0:
            print(f"epoch {epoch} dev recall@100 {(hit[0] / hit[1]).item():.4f}", flush=True)

        # refresh hard negatives (ranks 10..60) for the training rows this rank will see
        if epoch > 0:
            sampler.set_epoch(epoch)
            mine_rows = list(sampler)
            top = topk_items(engine, [train_feats[i] for i in mine_rows], items_mat, 60, device)
            hard_negs.clear()
            for i, row in zip(mine_rows, top.numpy()):
                row = row[10:]
                hard_negs[i] = row[row != train_items[i]]
        del items_mat
        engine.train()

        sampler.set_epoch(epoch)
        for step, (ids, offsets, pos, neg) in enumerate(loader):
            ids, offsets, pos, neg = ids.to(device), offsets.to(device), pos.to(device), neg.to(device)
            q, p, n = engine(ids, offsets, pos, neg)
            cands = torch.cat([p, n])
            logits = q.float() @ cands.float().T / args.temp
            loss = F.cross_entropy(logits, torch.arange(q.size(0), device=device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.0f}s", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
