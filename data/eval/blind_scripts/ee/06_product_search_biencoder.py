"""Query -> product bi-encoder for catalog search.

Training rows (parquet): query, pos_item_id, neg_item_ids (hard negatives mined with the
previous production model). Items are rendered as "title | brand | category".
Eval: the whole catalog is embedded (sharded over ranks), every rank builds a GPU flat
index and scores dev queries; we track Recall@{10,100} and MRR@10.

torchrun --nproc_per_node=8 06_product_search_biencoder.py --config conf/ps_v3.json
"""
import argparse
import json
import logging
import os
import random
import time

import faiss
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("ps_biencoder")

DEFAULT_CFG = {
    "encoder": "sentence-transformers/all-MiniLM-L12-v2",
    "train": "s3cache/ps/train_hn_v3.parquet",
    "dev": "s3cache/ps/dev_v3.parquet",
    "catalog": "s3cache/ps/catalog_v3.parquet",
    "out": "ckpt/ps_v3",
    "per_gpu_batch": 128,
    "n_hard": 3,
    "lr": 3e-5,
    "epochs": 4,
    "warmup_frac": 0.05,
    "scale": 20.0,
    "q_len": 24,
    "d_len": 64,
    "seed": 1234,
}


def render_item(row):
    return f"{row['title']} | {row.get('brand') or ''} | {row.get('category') or ''}"


class HardNegDataset(Dataset):
    def __init__(self, df, items, n_hard):
        self.q = df["query"].tolist()
        self.pos = df["pos_item_id"].tolist()
        self.negs = df["neg_item_ids"].tolist()
        self.items = items
        self.n_hard = n_hard

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        negs = list(self.negs[i])
        chosen = random.sample(negs, self.n_hard) if len(negs) >= self.n_hard else random.choices(negs, k=self.n_hard)
        docs = [self.items[self.pos[i]]] + [self.items[n] for n in chosen]
        return self.q[i], docs


class Tower(nn.Module):
    """Shared MiniLM tower with mean pooling + L2 norm (as in the serving stack)."""

    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def embed(self, ids, mask):
        h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return F.normalize((h * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=-1)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        return self.embed(q_ids, q_mask), self.embed(d_ids, d_mask)


def gather_with_grad(x):
    bufs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, x)
    bufs[dist.get_rank()] = x
    return torch.cat(bufs)


@torch.no_grad()
def embed_texts(tower, tok, texts, max_len, device, bs=1024):
    vecs = []
    for i in range(0, len(texts), bs):
        t = tok(texts[i:i + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        vecs.append(tower.embed(t["input_ids"], t["attention_mask"]).cpu())
    return torch.cat(vecs).numpy() if vecs else np.zeros((0, tower.enc.config.hidden_size), "float32")


def evaluate(tower, tok, cfg, catalog_ids, catalog_texts, dev_df, device, local_rank):
    rank, world = dist.get_rank(), dist.get_world_size()
    tower.eval()
    shard_ids = catalog_ids[rank::world]
    shard_vecs = embed_texts(tower, tok, catalog_texts[rank::world], cfg["d_len"], device)
    parts = [None] * world
    dist.all_gather_object(parts, (shard_ids, shard_vecs))
    ids = np.array([i for p in parts for i in p[0]])
    vecs = np.concatenate([p[1] for p in parts]).astype("float32")

    res = faiss.StandardGpuResources()
    index = faiss.index_cpu_to_gpu(res, local_rank, faiss.IndexFlatIP(vecs.shape[1]))
    index.add(vecs)

    dev_sampler = DistributedSampler(range(len(dev_df)), shuffle=False)
    my_rows = dev_df.iloc[list(iter(dev_sampler))]
    q_vecs = embed_texts(tower, tok, my_rows["query"].tolist(), cfg["q_len"], device)
    _, I = index.search(q_vecs, 100)

    hits10 = hits100 = rr = 0.0
    for gold, row in zip(my_rows["pos_item_ids"], I):
        gold = set(gold)
        ranked = ids[row]
        hits10 += float(any(x in gold for x in ranked[:10]))
        hits100 += float(any(x in gold for x in ranked))
        for r, x in enumerate(ranked[:10]):
            if x in gold:
                rr += 1.0 / (r + 1)
                break
    n = max(len(my_rows), 1)
    tower.train()
    return {"R@10": hits10 / n, "R@100": hits100 / n, "MRR@10": rr / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.config:
        cfg.update(json.load(open(cli.config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    catalog = pd.read_parquet(cfg["catalog"])
    items = {r["item_id"]: render_item(r) for r in catalog.to_dict("records")}
    catalog_ids = list(items.keys())
    catalog_texts = [items[i] for i in catalog_ids]
    train_df = pd.read_parquet(cfg["train"])
    dev_df = pd.read_parquet(cfg["dev"])

    tok = AutoTokenizer.from_pretrained(cfg["encoder"])

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=cfg["q_len"], truncation=True, padding=True, return_tensors="pt")
        d = tok([x for b in batch for x in b[1]], max_length=cfg["d_len"], truncation=True, padding=True,
                return_tensors="pt")
        return q["input_ids"], q["attention_mask"], d["input_ids"], d["attention_mask"]

    ds = HardNegDataset(train_df, items, cfg["n_hard"])
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["per_gpu_batch"], sampler=sampler, collate_fn=collate,
                    num_workers=8, drop_last=True, pin_memory=True)

    tower = Tower(cfg["encoder"]).to(device)
    model = DDP(tower, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    steps = len(dl) * cfg["epochs"]
    sched = get_linear_schedule_with_warmup(opt, int(cfg["warmup_frac"] * steps), steps)
    group = 1 + cfg["n_hard"]

    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
        json.dump(cfg, open(os.path.join(cfg["out"], "config.json"), "w"), indent=2)

    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (qi, qm, di, dm) in enumerate(dl):
            qi, qm, di, dm = (t.to(device, non_blocking=True) for t in (qi, qm, di, dm))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qv, dv = model(qi, qm, di, dm)
            qv, dv = gather_with_grad(qv.float()), gather_with_grad(dv.float())
            logits = cfg["scale"] * qv @ dv.t()
            labels = torch.arange(qv.size(0), device=device) * group
            loss = F.cross_entropy(logits, labels) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 200 == 0:
                logger.info("ep %d it %d/%d loss %.4f %.1fs", epoch, it, len(dl), loss.item() / world, time.time() - tic)

        metrics = evaluate(model.module, tok, cfg, catalog_ids, catalog_texts, dev_df, device, local_rank)
        if rank == 0:
            logger.info("epoch %d dev %s", epoch, json.dumps(metrics))
            model.module.enc.save_pretrained(os.path.join(cfg["out"], f"epoch{epoch}"))
            if metrics["MRR@10"] > best:
                best = metrics["MRR@10"]
                model.module.enc.save_pretrained(os.path.join(cfg["out"], "best"))
                tok.save_pretrained(os.path.join(cfg["out"], "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
