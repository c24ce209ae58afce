"""Fine-tune a shared-encoder dense retriever (E5 / Contriever style) on MS MARCO triples.

    torchrun --nproc_per_node=8 10_dense_retriever_wandb.py --triples data/msmarco/train_triples.jsonl \
        --dev-queries data/msmarco/dev_small_queries.jsonl --run-name e5-base-msmarco
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="intfloat/e5-base-unsupervised")
    ap.add_argument("--triples", required=True)
    ap.add_argument("--dev-queries", required=True)
    ap.add_argument("--output-dir", default="checkpoints")
    ap.add_argument("--run-name", default="retriever")
    ap.add_argument("--per-device-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-5, help="for the global batch (8 x 64)")
    ap.add_argument("--temperature", type=float, default=0.02)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-ratio", type=float, default=0.05)
    ap.add_argument("--q-max-len", type=int, default=32)
    ap.add_argument("--p-max-len", type=int, default=192)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class Triples(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return "query: " + r["query"], "passage: " + r["pos"], "passage: " + random.choice(r["negs"])


def make_collate(tok, q_len, p_len):
    def collate(batch):
        qs, pos, neg = zip(*batch)
        q = tok(list(qs), max_length=q_len, truncation=True, padding=True, return_tensors="pt")
        p = tok(list(pos) + list(neg), max_length=p_len, truncation=True, padding=True, return_tensors="pt")
        return q, p
    return collate


def mean_pool(hidden, mask):
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class Retriever(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, input_ids, attention_mask):
        out = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(mean_pool(out, attention_mask), dim=-1)

    def forward(self, q, p):
        return self.encode(**q), self.encode(**p)


def contrastive_loss(q, p, temperature):
    """q: [B, d], p: [2B, d] (B positives then B hard negatives), negatives from every GPU."""
    rank = dist.get_rank()
    all_q = torch.cat(torch.distributed.nn.all_gather(q), dim=0)
    all_p = torch.cat(torch.distributed.nn.all_gather(p), dim=0)
    b = q.size(0)
    scores = q @ all_p.t() / temperature
    # positive of local query i sits at row rank * 2B + i of all_p
    labels = torch.arange(b, device=q.device) + rank * 2 * b
    loss_q2p = F.cross_entropy(scores, labels)
    pos = p[:b]
    scores_p2q = pos @ all_q.t() / temperature
    loss_p2q = F.cross_entropy(scores_p2q, torch.arange(b, device=q.device) + rank * b)
    return (loss_q2p + loss_p2q) / 2


@torch.no_grad()
def dev_mrr(model, tok, rows, device, args, k=10):
    """MRR@10 of each dev query's positive against its own negatives (rank-0 sanity check)."""
    model.eval()
    rr = []
    for r in rows:
        cands = ["passage: " + r["pos"]] + ["passage: " + n for n in r["negs"]]
        q = tok(["query: " + r["query"]], max_length=args.q_max_len, truncation=True, return_tensors="pt").to(device)
        p = tok(cands, max_length=args.p_max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        s = (model.encode(**q) @ model.encode(**p).t())[0]
        rank_of_pos = int((s > s[0]).sum().item()) + 1
        rr.append(1.0 / rank_of_pos if rank_of_pos <= k else 0.0)
    model.train()
    return float(np.mean(rr))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    wandb.init(project="dense-retrieval", name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = Triples(args.triples)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.per_device_batch, sampler=sampler, num_workers=4, drop_last=True,
                    collate_fn=make_collate(tok, args.q_max_len, args.p_max_len), pin_memory=True)
    with open(args.dev_queries) as f:
        dev_rows = [json.loads(l) for l in f][:500]

    model = DDP(Retriever(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(dl) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q, p in dl:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q_emb, p_emb = model(q, p)
            loss = contrastive_loss(q_emb.float(), p_emb.float(), args.temperature)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": loss_avg.item(), "train/lr": scheduler.get_last_lr()[0],
                           "train/it_per_s": 20 / (time.time() - t0)}, step=step)
                t0 = time.time()

        if rank == 0:
            mrr = dev_mrr(model.module, tok, dev_rows, device, args)
            print(f"epoch {epoch}: dev MRR@10 {mrr:.4f}", flush=True)
            wandb.log({"dev/mrr@10": mrr, "epoch": epoch}, step=step)
            out = os.path.join(args.output_dir, args.run_name, f"epoch{epoch}")
            os.makedirs(out, exist_ok=True)
            model.module.enc.save_pretrained(out)
            tok.save_pretrained(out)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
