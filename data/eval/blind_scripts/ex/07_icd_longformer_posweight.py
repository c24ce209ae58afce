"""
ICD-10 coding of full discharge summaries with Clinical-Longformer (4096 tokens) and a label-wise
attention head. Rare codes are up-weighted with a clipped pos_weight in the BCE loss.

    torchrun --nproc_per_node=8 07_icd_longformer_posweight.py --config configs/icd10_longformer.yaml
"""
import argparse
import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


@dataclass
class Config:
    train_csv: str = "data/mimic4/icd10_train.csv"
    dev_csv: str = "data/mimic4/icd10_dev.csv"
    code_file: str = "data/mimic4/icd10_codes.txt"
    model_name: str = "yikuan8/Clinical-Longformer"
    output_dir: str = "runs/icd10_longformer"
    max_length: int = 4096
    batch_size: int = 2
    grad_accum: int = 4
    lr: float = 2e-5
    head_lr: float = 1e-3
    epochs: int = 15
    warmup_ratio: float = 0.05
    max_pos_weight: float = 30.0
    threshold: float = 0.4
    seed: int = 17
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


class NotesDataset(Dataset):
    def __init__(self, csv, tok, codes, max_length):
        df = pd.read_csv(csv, usecols=["text", "codes"])
        self.texts = df["text"].tolist()
        self.tok, self.max_length = tok, max_length
        idx = {c: i for i, c in enumerate(codes)}
        self.y = torch.zeros(len(df), len(codes))
        for r, cs in enumerate(df["codes"].fillna("")):
            for c in cs.split(";"):
                if c in idx:
                    self.y[r, idx[c]] = 1.0

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_length, padding="max_length",
                       return_tensors="pt")
        return enc["input_ids"][0], enc["attention_mask"][0], self.y[i]


class LongformerLWAN(nn.Module):
    def __init__(self, name, n_codes, att_dim=256):
        super().__init__()
        self.lf = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.lf.config.hidden_size
        self.proj = nn.Linear(h, att_dim)
        self.label_queries = nn.Parameter(torch.randn(n_codes, att_dim) * 0.02)
        self.label_out = nn.Parameter(torch.randn(n_codes, h) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_codes))

    def forward(self, input_ids, attention_mask):
        global_mask = torch.zeros_like(attention_mask)
        global_mask[:, 0] = 1
        h = self.lf(input_ids=input_ids, attention_mask=attention_mask,
                    global_attention_mask=global_mask).last_hidden_state     # B x T x H
        keys = torch.tanh(self.proj(h))                                      # B x T x A
        scores = torch.einsum("la,bta->blt", self.label_queries, keys)
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, -1e4)
        ctx = torch.einsum("blt,bth->blh", scores.softmax(-1), h)            # B x L x H
        return (ctx * self.label_out).sum(-1) + self.bias


def build_loss(train_y, max_pos_weight):
    pos = train_y.sum(0)
    neg = train_y.size(0) - pos
    pos_weight = (neg / pos.clamp(min=1)).clamp(max=max_pos_weight)
    return nn.BCEWithLogitsLoss(pos_weight=pos_weight.to(DEVICE))


@torch.no_grad()
def run_eval(model, loader, device, n_dev):
    model.eval()
    probs, golds = [], []
    for ids, mask, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids.to(device), mask.to(device))
        probs.append(torch.sigmoid(logits.float()))
        golds.append(y.to(device))
    probs, golds = torch.cat(probs), torch.cat(golds)
    world = dist.get_world_size()
    all_p = [torch.empty_like(probs) for _ in range(world)]
    all_g = [torch.empty_like(golds) for _ in range(world)]
    dist.all_gather(all_p, probs)
    dist.all_gather(all_g, golds)
    # interleave back into dataset order (DistributedSampler without shuffle is rank-strided), drop padding
    probs = torch.stack(all_p, 1).flatten(0, 1)[:n_dev].cpu().numpy()
    golds = torch.stack(all_g, 1).flatten(0, 1)[:n_dev].cpu().numpy()
    return probs, golds


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    codes = [c.strip() for c in open(cfg.code_file) if c.strip()]
    tok = AutoTokenizer.from_pretrained(cfg.model_name)
    train_ds = NotesDataset(cfg.train_csv, tok, codes, cfg.max_length)
    dev_ds = NotesDataset(cfg.dev_csv, tok, codes, cfg.max_length)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True,
                          drop_last=True)
    dev_dl = DataLoader(dev_ds, cfg.batch_size * 2, sampler=DistributedSampler(dev_ds, shuffle=False),
                        num_workers=4)

    model = LongformerLWAN(cfg.model_name, len(codes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = build_loss(train_ds.y, cfg.max_pos_weight)
    head = [p for n, p in model.named_parameters() if not n.startswith("module.lf.")]
    body = [p for n, p in model.named_parameters() if n.startswith("module.lf.")]
    optimizer = torch.optim.AdamW([{"params": body, "lr": cfg.lr}, {"params": head, "lr": cfg.head_lr}],
                                  weight_decay=0.01)
    updates = math.ceil(len(train_dl) / cfg.grad_accum) * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * updates), updates)

    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
    writer = SummaryWriter(os.path.join(cfg.output_dir, "tb")) if rank == 0 else None
    best, gstep = 0.0, 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            last_micro = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(train_dl)
            with (contextlib.nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids, mask)
                loss = criterion(logits.float(), y) / cfg.grad_accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                gstep += 1
                if writer is not None and gstep % 20 == 0:
                    writer.add_scalar("train/loss", loss.item() * cfg.grad_accum, gstep)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], gstep)

        probs, golds = run_eval(model.module, dev_dl, device, len(dev_ds))
        if rank == 0:
            preds = (probs >= cfg.threshold).astype(int)
            micro = f1_score(golds, preds, average="micro", zero_division=0)
            macro = f1_score(golds, preds, average="macro", zero_division=0)
            auc = roc_auc_score(golds[:, golds.sum(0) > 0], probs[:, golds.sum(0) > 0], average="macro")
            writer.add_scalar("dev/micro_f1", micro, epoch)
            writer.add_scalar("dev/macro_f1", macro, epoch)
            writer.add_scalar("dev/macro_auc", auc, epoch)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): micro-F1 {micro:.4f} macro-F1 {macro:.4f} "
                  f"macro-AUC {auc:.4f}", flush=True)
            if micro > best:
                best = micro
                torch.save({"model": model.module.state_dict(), "codes": codes, "cfg": cfg.__dict__},
                           os.path.join(cfg.output_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
