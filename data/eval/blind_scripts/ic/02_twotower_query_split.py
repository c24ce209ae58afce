"""DSSM-style two-tower retrieval model trained on search click logs.

Both towers hash character trigrams + word unigrams into an EmbeddingBag and
run a small MLP on top.  Training uses sampled softmax with in-batch negatives;
dev metrics are MRR@10 and NDCG@10 against the full catalog.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 02_twotower_query_split.py --config configs/dssm_base.yaml
"""
import argparse
import os
import random
import time
import zlib
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

NUM_BUCKETS = 2 ** 21


def hash_features(text):
    text = text.lower().strip()
    feats = [zlib.crc32(f"w:{w}".encode()) % NUM_BUCKETS for w in text.split()]
    padded = f"#{text}#"
    feats += [zlib.crc32(f"c:{padded[i:i + 3]}".encode()) % NUM_BUCKETS for i in range(len(padded) - 2)]
    return feats or [0]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class Tower(nn.Module):
    def __init__(self, dim, hidden, out_dim, dropout):
        super().__init__()
        self.bag = nn.EmbeddingBag(NUM_BUCKETS, dim, mode="mean", sparse=False)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, ids, offsets):
        return F.normalize(self.mlp(self.bag(ids, offsets)), dim=-1)


class DSSM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.query_tower = Tower(cfg["emb_dim"], cfg["hidden"], cfg["out_dim"], cfg["dropout"])
        self.item_tower = Tower(cfg["emb_dim"], cfg["hidden"], cfg["out_dim"], cfg["dropout"])
        self.log_temp = nn.Parameter(torch.tensor(np.log(1 / 0.05), dtype=torch.float32))

    def forward(self, q_ids, q_off, p_ids, p_off):
        q = self.query_tower(q_ids, q_off)
        p = self.item_tower(p_ids, p_off)
        return q, p, self.log_temp.exp().clamp(max=100)


class ClickPairs(Dataset):
    def __init__(self, pairs, q_feats, p_feats):
        self.pairs, self.q_feats, self.p_feats = pairs, q_feats, p_feats

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        qid, pid = self.pairs[i]
        return self.q_feats[qid], self.p_feats[pid]


def to_bag(seqs, device):
    lengths = torch.tensor([len(s) for s in seqs])
    offsets = torch.zeros(len(seqs), dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return ids.to(device, non_blocking=True), offsets.to(device, non_blocking=True)


def collate(batch):
    qs, ps = zip(*batch)
    return list(qs), list(ps)


def load_click_logs(path, min_clicks):
    df = pd.read_parquet(path, columns=["query_id", "query", "product_id", "clicks", "add_to_cart", "orders"])
    df = df[df.clicks >= min_clicks]
    # graded relevance: order 3, add-to-cart 2, click 1
    df["grade"] = np.where(df.orders > 0, 3, np.where(df.add_to_cart > 0, 2, 1))
    return df


@torch.no_grad()
def encode_all(tower, feats_list, device, bs=4096):
    tower.eval()
    out = []
    for i in range(0, len(feats_list), bs):
        ids, off = to_bag(feats_list[i:i + bs], device)
        out.append(tower(ids, off))
    return torch.cat(out)


@torch.no_grad()
def evaluate(raw_model, dev_qids, q_feats, item_emb, item_ids, grades, device, rank, world, k=10):
    mine = dev_qids[rank::world]
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    discounts = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))
    for i in range(0, len(mine), 1024):
        chunk = mine[i:i + 1024]
        q = encode_all(raw_model.query_tower, [q_feats[x] for x in chunk], device)
        top = (q @ item_emb.T).topk(k, dim=1).indices.cpu().numpy()
        for qid, row in zip(chunk, top):
            g = grades[qid]
            gains = torch.tensor([(2 ** g.get(item_ids[j], 0)) - 1 for j in row], dtype=torch.float64)
            ideal = torch.tensor(sorted(((2 ** v) - 1 for v in g.values()), reverse=True)[:k], dtype=torch.float64)
            idcg = (ideal * discounts[: len(ideal)]).sum()
            totals[0] += ((gains * discounts).sum() / idcg).item() if idcg > 0 else 0.0
            hit = [r for r, j in enumerate(row) if item_ids[j] in g]
            totals[1] += 1.0 / (hit[0] + 1) if hit else 0.0
            totals[2] += 1
    dist.all_reduce(totals)
    n = max(totals[2].item(), 1.0)
    return totals[0].item() / n, totals[1].item() / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    # different dropout masks / negative order on every rank
    seed_everything(cfg["seed"] + rank)

    clicks = load_click_logs(cfg["click_logs"], cfg.get("min_clicks", 1))
    catalog = pd.read_parquet(cfg["catalog"], columns=["product_id", "title", "brand"])

    # query-level split so no query appears in both train and dev
    all_qids = sorted(clicks.query_id.unique().tolist())
    random.shuffle(all_qids)
    n_dev = int(len(all_qids) * cfg.get("dev_fraction", 0.02))
    dev_set = set(all_qids[:n_dev])

    q_text = dict(zip(clicks.query_id, clicks["query"]))
    q_feats = {qid: hash_features(t) for qid, t in q_text.items()}
    item_ids = catalog.product_id.tolist()
    p_feats = {pid: hash_features(f"{t} {b}") for pid, t, b in zip(catalog.product_id, catalog.title, catalog.brand)}

    train_pairs, grades = [], defaultdict(dict)
    for qid, pid, grade in zip(clicks.query_id, clicks.product_id, clicks.grade):
        if pid not in p_feats:
            continue
        if qid in dev_set:
            grades[qid][pid] = int(grade)
        else:
            train_pairs.append((qid, pid))
    dev_qids = sorted(grades)
    if rank == 0:
        print(f"train pairs {len(train_pairs):,}  dev queries {len(dev_qids):,}  catalog {len(item_ids):,}")

    model = DSSM(cfg["model"]).to(device)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    ds = ClickPairs(train_pairs, q_feats, p_feats)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True, persistent_workers=True)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    if args.resume:
        opt.load_state_dict(ckpt["optim"])

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    global_step = start_epoch * len(loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for qs, ps in loader:
            q_ids, q_off = to_bag(qs, device)
            p_ids, p_off = to_bag(ps, device)
            q, p, scale = model(q_ids, q_off, p_ids, p_off)
            logits = scale * q @ p.T
            target = torch.arange(q.size(0), device=device)
            loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            global_step += 1
            if writer is not None and global_step % 200 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/temp", 1.0 / scale.item(), global_step)

        raw = model.module
        item_emb = encode_all(raw.item_tower, [p_feats[p] for p in item_ids], device)
        ndcg, mrr = evaluate(raw, dev_qids, q_feats, item_emb, item_ids, grades, device, rank, world)
        del item_emb
        if rank == 0:
            print(f"epoch {epoch}  ndcg@10 {ndcg:.4f}  mrr@10 {mrr:.4f}  {time.time() - t0:.0f}s", flush=True)
            writer.add_scalar("dev/ndcg@10", ndcg, epoch)
            writer.add_scalar("dev/mrr@10", mrr, epoch)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": raw.state_dict(), "optim": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"epoch{epoch:02d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
