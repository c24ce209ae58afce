"""Multi-dataset sentence-embedding training with Dynamic Weight Average (Liu et al., 2019).

    nli   : AllNLI (entailment pairs + hard-negative contradiction), in-batch negatives
    qqp   : Quora duplicate questions, in-batch negatives
    sts   : STS-B train, cosine-similarity regression

Each task owns a small projection head on top of the shared mean-pooled encoder.
Tasks are visited round-robin; DWA re-weights them once per epoch from the
(all-reduced) epoch losses.

    torchrun --nproc_per_node=4 19_sentence_embeddings_dwa.py --data /data/sent_emb --out runs/st_dwa
"""
import argparse
import csv
import gzip
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

TASKS = ["nli", "qqp", "sts"]


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def load_rows(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(l) for l in f]


class SentenceEncoder(nn.Module):
    def __init__(self, name, dim=768):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.bert.config.hidden_size
        self.proj = nn.ModuleDict({t: nn.Linear(h, dim) for t in TASKS})

    def encode(self, enc):
        hs = self.bert(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(hs.dtype)
        return (hs * m).sum(1) / m.sum(1).clamp(min=1e-6)

    def forward(self, task, *encs):
        return [F.normalize(self.proj[task](self.encode(e)), dim=-1) for e in encs]


def tokenize(tok, texts, device, max_len=128):
    enc = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return {k: v.to(device, non_blocking=True) for k, v in enc.items()}


def task_loss(task, embs, batch, scale):
    if task in ("nli", "qqp"):
        a, p = embs[0], embs[1]
        cands = torch.cat([p, embs[2]]) if len(embs) == 3 else p
        logits = scale * a @ cands.T
        return F.cross_entropy(logits, torch.arange(a.size(0), device=a.device))
    cos = (embs[0] * embs[1]).sum(-1)
    return F.mse_loss(cos, batch["score"].to(cos.device) / 5.0)


def collate(rows):
    out = {"a": [r["a"] for r in rows], "b": [r["b"] for r in rows]}
    if "neg" in rows[0]:
        out["neg"] = [r["neg"] for r in rows]
    if "score" in rows[0]:
        out["score"] = torch.tensor([float(r["score"]) for r in rows])
    return out


def dwa_weights(hist, T=2.0):
    if len(hist) < 2:
        return np.ones(len(TASKS))
    r = np.array(hist[-1]) / np.array(hist[-2])
    e = np.exp(r / T)
    return len(TASKS) * e / e.sum()


@torch.no_grad()
def sts_dev_spearman(model, tok, pairs, device, bs=256):
    model.eval()
    sims, gold = [], []
    for i in range(0, len(pairs), bs):
        chunk = pairs[i:i + bs]
        ea = model.encode(tokenize(tok, [p["a"] for p in chunk], device))
        eb = model.encode(tokenize(tok, [p["b"] for p in chunk], device))
        sims.extend(F.cosine_similarity(ea, eb).tolist())
        gold.extend(float(p["score"]) for p in chunk)
    model.train()
    return spearmanr(sims, gold).correlation


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="microsoft/mpnet-base")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--scale", type=float, default=20.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    sets = {t: Rows(load_rows(os.path.join(args.data, f"{t}_train.jsonl.gz"))) for t in TASKS}
    sts_dev = load_rows(os.path.join(args.data, "sts_dev.jsonl.gz"))
    samplers = {t: DistributedSampler(ds, shuffle=True, seed=3) for t, ds in sets.items()}
    loaders = {t: DataLoader(ds, batch_size=args.bs, sampler=samplers[t], collate_fn=collate,
                             num_workers=2, drop_last=True) for t, ds in sets.items()}
    steps_per_task = min(len(l) for l in loaders.values())

    model = DDP(SentenceEncoder(args.model).to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * steps_per_task * len(TASKS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (0.1 * total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    hist, best = [], -1.0
    for epoch in range(args.epochs):
        w = dwa_weights(hist)
        for t in TASKS:
            samplers[t].set_epoch(epoch)
        its = {t: iter(l) for t, l in loaders.items()}
        ep_loss = torch.zeros(len(TASKS), device=device)
        t0 = time.time()
        for i in range(steps_per_task * len(TASKS)):
            k = i % len(TASKS)
            task = TASKS[k]
            batch = next(its[task])
            encs = [tokenize(tok, batch["a"], device), tokenize(tok, batch["b"], device)]
            if "neg" in batch:
                encs.append(tokenize(tok, batch["neg"], device))
            embs = model(task, *encs)
            loss = task_loss(task, embs, batch, args.scale)
            opt.zero_grad(set_to_none=True)
            (w[k] * loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ep_loss[k] += loss.detach()
            if rank == 0 and i % 300 == 0:
                print(f"ep {epoch} it {i} {task} loss {loss.item():.4f} w {np.round(w, 3)}", flush=True)

        dist.all_reduce(ep_loss)
        hist.append((ep_loss / (world * steps_per_task)).tolist())

        if rank == 0:
            rho = sts_dev_spearman(model, tok, sts_dev, device)
            print(f"epoch {epoch} {time.time() - t0:.0f}s task losses {np.round(hist[-1], 4)} sts-dev {rho:.4f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "hist": hist},
                       os.path.join(args.out, "last.pt"))
            if rho > best:
                best = rho
                model.module.bert.save_pretrained(os.path.join(args.out, "best_encoder"))
                tok.save_pretrained(os.path.join(args.out, "best_encoder"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
