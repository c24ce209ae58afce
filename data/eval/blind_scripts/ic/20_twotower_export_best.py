"""Train a two-tower retriever on click logs and export the best epoch for serving.

After training, rank 0 reloads the best checkpoint into a fresh model, encodes the
full catalog and writes:
    <out>/serving/query_encoder/   (HF format, used by the online query service)
    <out>/serving/product_vecs.npy (+ product_ids.npy) for the ANN index build job

    torchrun --nproc_per_node=8 20_twotower_export_best.py --data /data/search/clicks_v9 --out /data/runs/tt_v9
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("tt_export")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="intfloat/multilingual-e5-small")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--tau", type=float, default=0.03)
    return ap.parse_args()


class TwoTower(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.query_encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.product_encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    @staticmethod
    def mean_pool(enc, ids, mask):
        h = enc(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1)

    def forward(self, q_ids, q_mask, p_ids, p_mask):
        return self.mean_pool(self.query_encoder, q_ids, q_mask), self.mean_pool(self.product_encoder, p_ids, p_mask)


class Clicks(Dataset):
    def __init__(self, df, ptext):
        self.q = ("query: " + df["query"]).tolist()
        self.p = [ptext[x] for x in df.product_id]

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.q[i], self.p[i]


@torch.no_grad()
def encode(enc, tok, texts, max_len, device, bs=1024):
    out = []
    for i in range(0, len(texts), bs):
        t = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(TwoTower.mean_pool(enc, t["input_ids"], t["attention_mask"]).float())
    return torch.cat(out) if out else torch.empty(0, enc.config.hidden_size, device=device)


@torch.no_grad()
def dev_metrics(raw, tok, dev_df, ptext, device, rank, world, pool=4096):
    """In-pool MRR@10 / recall@10: each chunk of `pool` dev clicks is scored against its own products."""
    raw.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    starts = list(range(0, len(dev_df), pool))[rank::world]
    for s in starts:
        chunk = dev_df.iloc[s:s + pool]
        q = encode(raw.query_encoder, tok, ("query: " + chunk["query"]).tolist(), 32, device)
        p = encode(raw.product_encoder, tok, [ptext[x] for x in chunk.product_id], 96, device)
        sim = q @ p.T
        rank_pos = (sim > sim.diagonal().unsqueeze(1)).sum(1)
        acc[0] += torch.where(rank_pos < 10, 1.0 / (rank_pos + 1).double(), torch.zeros_like(rank_pos, dtype=torch.float64)).sum()
        acc[1] += (rank_pos < 10).sum()
        acc[2] += len(chunk)
    dist.all_reduce(acc)
    raw.train()
    return (acc[0] / acc[2].clamp(min=1)).item(), (acc[1] / acc[2].clamp(min=1)).item()


def export_for_serving(args, tok, ptext, device):
    best = TwoTower(args.encoder)
    best.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location="cpu"))
    best.to(device).eval()
    serve_dir = os.path.join(args.out, "serving")
    os.makedirs(serve_dir, exist_ok=True)
    best.query_encoder.save_pretrained(os.path.join(serve_dir, "query_encoder"))
    tok.save_pretrained(os.path.join(serve_dir, "query_encoder"))
    pids = sorted(ptext)
    vecs = encode(best.product_encoder, tok, [ptext[p] for p in pids], 96, device)
    np.save(os.path.join(serve_dir, "product_vecs.npy"), vecs.cpu().numpy().astype(np.float16))
    np.save(os.path.join(serve_dir, "product_ids.npy"), np.asarray(pids))
    logger.info("exported %d product vectors to %s", len(pids), serve_dir)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    products = pd.read_parquet(os.path.join(args.data, "products.parquet"), columns=["product_id", "title", "brand"])
    ptext = {pid: f"passage: {t} {b or ''}".strip() for pid, t, b in zip(products.product_id, products.title, products.brand)}
    clicks = pd.read_parquet(os.path.join(args.data, "clicks.parquet"), columns=["query_id", "query", "product_id", "split"])
    clicks = clicks[clicks.product_id.isin(ptext.keys())]
    train_df = clicks[clicks.split == "train"]
    dev_df = clicks[clicks.split == "dev"].sort_values(["query_id", "product_id"]).reset_index(drop=True)

    tok = AutoTokenizer.from_pretrained(args.encoder)

    def collate(batch):
        qs, ps = zip(*batch)
        q = tok(list(qs), padding=True, truncation=True, max_length=32, return_tensors="pt")
        p = tok(list(ps), padding=True, truncation=True, max_length=96, return_tensors="pt")
        return q["input_ids"], q["attention_mask"], p["input_ids"], p["attention_mask"]

    train_ds = Clicks(train_df, ptext)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)

    model = DDP(TwoTower(args.encoder).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    best_mrr = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (qi, qm, pi, pm) in enumerate(loader):
            qi, qm, pi, pm = (x.to(device, non_blocking=True) for x in (qi, qm, pi, pm))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, p = model(qi, qm, pi, pm)
            sim = q.float() @ p.float().T / args.tau
            labels = torch.arange(sim.size(0), device=device)
            loss = F.cross_entropy(sim, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(loader), loss.item())

        mrr, r10 = dev_metrics(model.module, tok, dev_df, ptext, device, rank, world)
        logger.info("epoch %d dev MRR@10 %.4f R@10 %.4f (%.0fs)", epoch, mrr, r10, time.time() - t0)
        if rank == 0 and mrr > best_mrr:
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
            logger.info("new best, saved")
        best_mrr = max(best_mrr, mrr)
        dist.barrier()

    dist.destroy_process_group()
    # serving export is single-process work, no collectives needed
    if rank == 0:
        export_for_serving(args, tok, ptext, device)


if __name__ == "__main__":
    main()
