"""Cross-encoder ranker trained directly on impression-level click feedback.

Each training example is one search impression: the query and the (up to) 20
products that were shown, with click counts.  The loss is ListNet-style softmax
cross entropy against the normalised click distribution of the impression, with
inverse-propensity weights per position to correct for position bias.

    torchrun --nproc_per_node=8 07_crossenc_click_labels.py --cfg cfg/ce_clicks.json
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

DEFAULTS = {
    "model": "cross-encoder/ms-marco-MiniLM-L-6-v2",
    "train_path": "/data/ltr/impressions_train.parquet",
    "dev_path": "/data/ltr/judged_dev.parquet",
    "list_size": 20,
    "impressions_per_gpu": 4,
    "max_len": 128,
    "lr": 3e-5,
    "epochs": 2,
    "warmup_ratio": 0.05,
    "propensity": [1.0, 0.72, 0.58, 0.49, 0.43, 0.38, 0.35, 0.32, 0.30, 0.28,
                   0.26, 0.25, 0.24, 0.23, 0.22, 0.21, 0.20, 0.20, 0.19, 0.19],
    "out": "/data/ltr/ckpt/ce_clicks",
}


class Impressions(Dataset):
    def __init__(self, path, list_size):
        t = pq.read_table(path, columns=["query", "titles", "positions", "clicks"]).to_pydict()
        self.query, self.titles, self.positions, self.clicks = t["query"], t["titles"], t["positions"], t["clicks"]
        self.list_size = list_size

    def __len__(self):
        return len(self.query)

    def __getitem__(self, i):
        n = min(len(self.titles[i]), self.list_size)
        titles = list(self.titles[i][:n]) + [""] * (self.list_size - n)
        clicks = np.zeros(self.list_size, dtype=np.float32)
        clicks[:n] = self.clicks[i][:n]
        pos = np.full(self.list_size, self.list_size - 1, dtype=np.int64)
        pos[:n] = np.minimum(self.positions[i][:n], self.list_size - 1)
        valid = np.zeros(self.list_size, dtype=bool)
        valid[:n] = True
        return self.query[i], titles, clicks, pos, valid


def make_collate(tok, max_len):
    def collate(batch):
        queries, titles, clicks, pos, valid = zip(*batch)
        flat_q = [q for q, ts in zip(queries, titles) for _ in ts]
        flat_t = [t for ts in titles for t in ts]
        enc = tok(flat_q, flat_t, padding=True, truncation="only_second", max_length=max_len, return_tensors="pt")
        return (enc, torch.from_numpy(np.stack(clicks)), torch.from_numpy(np.stack(pos)),
                torch.from_numpy(np.stack(valid)))
    return collate


def listnet_loss(scores, clicks, weights, valid):
    scores = scores.masked_fill(~valid, -1e4)
    target = clicks * weights
    target = target / target.sum(dim=1, keepdim=True)
    return -(target * F.log_softmax(scores, dim=1)).sum(dim=1).mean()


@torch.no_grad()
def eval_ndcg(model, tok, dev_path, max_len, device, rank, world, k=10):
    """Judged dev set: one row per (query, product, grade 0-3); queries sharded across ranks."""
    t = pq.read_table(dev_path, columns=["query_id", "query", "title", "grade"]).to_pandas()
    groups = [g for _, g in sorted(t.groupby("query_id"), key=lambda x: x[0])]
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for g in groups[rank::world]:
        enc = tok(list(g["query"]), list(g["title"]), padding=True, truncation="only_second",
                  max_length=max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = model(**enc).logits.squeeze(-1).float().cpu().numpy()
        grades = g["grade"].to_numpy()[np.argsort(-s)][:k]
        ideal = np.sort(g["grade"].to_numpy())[::-1][:k]
        idcg = ((2.0 ** ideal - 1) * disc[: len(ideal)]).sum()
        if idcg > 0:
            total[0] += ((2.0 ** grades - 1) * disc[: len(grades)]).sum() / idcg
            total[1] += 1
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForSequenceClassification.from_pretrained(cfg["model"], num_labels=1).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    propensity = torch.tensor(cfg["propensity"], device=device)

    ds = Impressions(cfg["train_path"], cfg["list_size"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["impressions_per_gpu"], sampler=sampler, num_workers=6,
                        collate_fn=make_collate(tok, cfg["max_len"]), pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    total_steps = cfg["epochs"] * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, int(cfg["warmup_ratio"] * total_steps), total_steps)
    if rank == 0:
        print(f"{len(ds):,} impressions, {len(loader)} steps/epoch/rank, world {world}", flush=True)

    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0, seen = time.time(), 0
        for step, (enc, clicks, pos, valid) in enumerate(loader):
            clicks, pos, valid = clicks.to(device), pos.to(device), valid.to(device)
            # impressions without any click carry no preference signal
            keep = clicks.sum(dim=1) > 0
            if not keep.any():
                continue
            row_keep = keep.repeat_interleave(cfg["list_size"])
            enc = {k: v[row_keep.cpu()].to(device, non_blocking=True) for k, v in enc.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores = ddp_model(**enc).logits.view(-1, cfg["list_size"]).float()
            weights = 1.0 / propensity[pos[keep]]
            loss = listnet_loss(scores, clicks[keep], weights, valid[keep])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            sched.step()
            seen += int(keep.sum())
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {seen / (time.time() - t0):.1f} imp/s", flush=True)

        ndcg = eval_ndcg(model, tok, cfg["dev_path"], cfg["max_len"], device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev NDCG@10 {ndcg:.4f}", flush=True)
            os.makedirs(cfg["out"], exist_ok=True)
            model.save_pretrained(os.path.join(cfg["out"], f"epoch{epoch}"))
            if ndcg > best:
                best = ndcg
                model.save_pretrained(os.path.join(cfg["out"], "best"))
                tok.save_pretrained(os.path.join(cfg["out"], "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
