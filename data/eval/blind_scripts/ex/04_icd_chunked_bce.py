"""
PLM-ICD style training: long discharge summaries are split into 512-token windows, every window is
encoded by the PLM, token states of all windows are concatenated and a label-wise attention layer
produces one logit per ICD code.

    torchrun --nnodes=1 --nproc_per_node=4 04_icd_chunked_bce.py \
        --train data/mimic4_icd10/train.csv --dev data/mimic4_icd10/dev.csv \
        --codes data/mimic4_icd10/codes.txt --model RoBERTa-base-PM-M3-Voc-distill-align-hf
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
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--codes", required=True)
    ap.add_argument("--model", default="RoBERTa-base-PM-M3-Voc-distill-align-hf")
    ap.add_argument("--cache_dir", default="cache")
    ap.add_argument("--out", default="out/plm_icd")
    ap.add_argument("--chunk_size", type=int, default=128)
    ap.add_argument("--max_chunks", type=int, default=24)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def tokenize_notes(df, tok, chunk_size, max_chunks, code2id):
    items = []
    max_tokens = chunk_size * max_chunks
    for text, codes in zip(df["text"], df["icd10"]):
        ids = tok(text, add_special_tokens=False, truncation=True, max_length=max_tokens)["input_ids"]
        n_chunks = max(1, -(-len(ids) // chunk_size))
        ids = ids + [tok.pad_token_id] * (n_chunks * chunk_size - len(ids))
        labels = [code2id[c] for c in codes.split(";") if c in code2id]
        items.append({"input_ids": torch.tensor(ids).view(n_chunks, chunk_size),
                      "attention_mask": (torch.tensor(ids) != tok.pad_token_id).long().view(n_chunks, chunk_size),
                      "labels": labels})
    return items


def load_or_build(path_csv, tok, args, code2id, split):
    cache = os.path.join(args.cache_dir, f"{split}_{os.path.basename(args.model)}_{args.chunk_size}x{args.max_chunks}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    df = pd.read_csv(path_csv, usecols=["hadm_id", "text", "icd10"])
    items = tokenize_notes(df, tok, args.chunk_size, args.max_chunks, code2id)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(items, cache)
    return items


class ChunkedNotes(Dataset):
    def __init__(self, items, num_labels):
        self.items, self.num_labels = items, num_labels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        y = torch.zeros(self.num_labels)
        y[it["labels"]] = 1.0
        return i, it["input_ids"], it["attention_mask"], y


def collate(batch):
    idx, ids, masks, ys = zip(*batch)
    n = max(x.size(0) for x in ids)
    pad = lambda x: F.pad(x, (0, 0, 0, n - x.size(0)))
    return torch.tensor(idx), torch.stack([pad(x) for x in ids]), torch.stack([pad(m) for m in masks]), torch.stack(ys)


class PLMICD(nn.Module):
    def __init__(self, model_name, num_labels, att_dim=512):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(model_name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.first = nn.Linear(h, att_dim, bias=False)
        self.second = nn.Linear(att_dim, num_labels, bias=False)
        self.third = nn.Linear(h, num_labels)

    def forward(self, input_ids, attention_mask):
        b, c, t = input_ids.shape
        hs = self.encoder(input_ids=input_ids.view(-1, t), attention_mask=attention_mask.view(-1, t)).last_hidden_state
        hs = hs.view(b, c * t, -1)
        mask = attention_mask.view(b, c * t)
        att = self.second(torch.tanh(self.first(hs))).transpose(1, 2)      # b x L x (c*t)
        att = att.masked_fill(mask.unsqueeze(1) == 0, -1e4).softmax(-1)
        m = att @ hs                                                      # b x L x h
        return self.third.weight.mul(m).sum(-1) + self.third.bias


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    idx_all, prob_all, gold_all = [], [], []
    for idx, ids, mask, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids.to(device), mask.to(device))
        idx_all.append(idx.numpy())
        prob_all.append(torch.sigmoid(logits.float()).cpu().numpy())
        gold_all.append(y.numpy())
    local = (np.concatenate(idx_all), np.concatenate(prob_all), np.concatenate(gold_all))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    # DistributedSampler repeats a few samples to even out the shards; keep one copy per document
    seen, probs, golds = set(), [], []
    for idx, p, g in parts:
        for k, i in enumerate(idx):
            if i not in seen:
                seen.add(i)
                probs.append(p[k])
                golds.append(g[k])
    return np.stack(probs), np.stack(golds)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    codes = [l.strip() for l in open(args.codes) if l.strip()]
    code2id = {c: i for i, c in enumerate(codes)}
    tok = AutoTokenizer.from_pretrained(args.model)
    train_items = load_or_build(args.train, tok, args, code2id, "train")
    dev_items = load_or_build(args.dev, tok, args, code2id, "dev")
    train_ds, dev_ds = ChunkedNotes(train_items, len(codes)), ChunkedNotes(dev_items, len(codes))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=4, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    model = DDP(PLMICD(args.model, len(codes)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = len(train_dl) // args.grad_accum * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, steps)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for step, (_, ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            sync = (step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids, mask)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
                (loss / args.grad_accum).backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        probs, golds = predict(model.module, dev_dl, device)
        if rank == 0:
            pred = (probs > 0.5).astype(int)
            mi = f1_score(golds, pred, average="micro", zero_division=0)
            ma = f1_score(golds, pred, average="macro", zero_division=0)
            log.info(f"ep {epoch} loss {(tot[0] / tot[1]).item():.4f} dev miF1 {mi:.4f} maF1 {ma:.4f} "
                     f"({time.time() - t0:.0f}s)")
            if mi > best:
                best = mi
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
