"""
Hierarchical transformer for ICD coding of our in-house discharge letters (EHR export, ICD-10-GM).
Level 1: clinical BERT over 256-token segments. Level 2: 2-layer transformer over segment vectors,
then a label-wise attention decoder. Loss: BCE with label smoothing on negatives.

The export has no official dev set; 10% of the admissions are held out for model selection.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        13_icd_hier_bert.py --notes /shared/icd_export/notes.parquet --out /shared/runs/hier_icd
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="GerMedBERT/medbert-512")
    ap.add_argument("--seg_len", type=int, default=256)
    ap.add_argument("--max_segs", type=int, default=20)
    ap.add_argument("--min_code_freq", type=int, default=10)
    ap.add_argument("--dev_frac", type=float, default=0.1)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--neg_smoothing", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SegmentedLetters(Dataset):
    def __init__(self, df, tok, codes, seg_len, max_segs):
        self.df = df.reset_index(drop=True)
        self.tok, self.seg_len, self.max_segs = tok, seg_len, max_segs
        self.code_idx = {c: i for i, c in enumerate(codes)}

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        ids = self.tok(row["text"], add_special_tokens=False)["input_ids"]
        body = self.seg_len - 2
        segs = [ids[k:k + body] for k in range(0, len(ids), body)][: self.max_segs] or [[]]
        x = torch.full((self.max_segs, self.seg_len), self.tok.pad_token_id, dtype=torch.long)
        for s, seg in enumerate(segs):
            seg = [self.tok.cls_token_id] + seg + [self.tok.sep_token_id]
            x[s, : len(seg)] = torch.tensor(seg)
        seg_mask = torch.zeros(self.max_segs, dtype=torch.bool)
        seg_mask[: len(segs)] = True
        y = torch.zeros(len(self.code_idx))
        for c in row["codes"]:
            if c in self.code_idx:
                y[self.code_idx[c]] = 1
        return x, seg_mask, y


class HierICD(nn.Module):
    def __init__(self, encoder, n_codes, n_layers=2):
        super().__init__()
        self.enc = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        layer = nn.TransformerEncoderLayer(h, nhead=8, dim_feedforward=2 * h, batch_first=True)
        self.doc = nn.TransformerEncoder(layer, n_layers)
        self.seg_pos = nn.Embedding(64, h)
        self.label_emb = nn.Parameter(torch.randn(n_codes, h) * 0.02)
        self.final = nn.Linear(h, n_codes)

    def forward(self, x, seg_mask, pad_id):
        b, s, t = x.shape
        flat = x.view(b * s, t)
        segs = self.enc(input_ids=flat, attention_mask=(flat != pad_id).long()).last_hidden_state[:, 0]
        segs = segs.view(b, s, -1) + self.seg_pos(torch.arange(s, device=x.device))
        d = self.doc(segs, src_key_padding_mask=~seg_mask)
        att = torch.einsum("lh,bsh->bls", self.label_emb, d).masked_fill(~seg_mask[:, None], -1e4)
        ctx = att.softmax(-1) @ d
        return (ctx * self.final.weight).sum(-1) + self.final.bias


def evaluate(model, loader, device, pad_id, n_codes):
    model.eval()
    tp = torch.zeros(n_codes, device=device)
    fp, fn = torch.zeros_like(tp), torch.zeros_like(tp)
    with torch.no_grad():
        for x, m, y in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x.to(device), m.to(device), pad_id)
            pred = (logits.float() > 0).float()
            y = y.to(device)
            tp += (pred * y).sum(0)
            fp += (pred * (1 - y)).sum(0)
            fn += ((1 - pred) * y).sum(0)
    for t in (tp, fp, fn):
        dist.all_reduce(t)
    micro = (2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp(min=1)).item()
    per_code = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
    return micro, per_code.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_all(args.seed + rank)

    df = pd.read_parquet(args.notes, columns=["case_id", "text", "codes"])
    df["codes"] = df["codes"].apply(lambda s: sorted(set(s.split("|"))))
    counts = df["codes"].explode().value_counts()
    codes = sorted(counts[counts >= args.min_code_freq].index.tolist())

    case_ids = df["case_id"].unique().tolist()
    random.shuffle(case_ids)
    n_dev = int(len(case_ids) * args.dev_frac)
    dev_cases = set(case_ids[:n_dev])
    train_df = df[~df["case_id"].isin(dev_cases)]
    dev_df = df[df["case_id"].isin(dev_cases)]

    tok = AutoTokenizer.from_pretrained(args.encoder)
    train_ds = SegmentedLetters(train_df, tok, codes, args.seg_len, args.max_segs)
    dev_ds = SegmentedLetters(dev_df, tok, codes, args.seg_len, args.max_segs)
    if rank == 0:
        print(f"{len(train_ds)} train / {len(dev_ds)} dev letters, {len(codes)} codes, world {world}", flush=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=4, num_workers=4)

    model = DDP(HierICD(args.encoder, len(codes)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.06 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, m, y in train_dl:
            x, m, y = x.to(device, non_blocking=True), m.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, m, tok.pad_token_id)
            target = y.clamp(min=args.neg_smoothing)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        micro, macro = evaluate(model.module, dev_dl, device, tok.pad_token_id, len(codes))
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) dev micro-F1 {micro:.4f} macro-F1 {macro:.4f}", flush=True)
            if micro > best:
                best = micro
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "codes": codes, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
