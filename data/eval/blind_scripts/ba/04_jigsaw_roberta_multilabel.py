#!/usr/bin/env python
# Jigsaw Toxic Comment Classification - roberta multilabel, k-fold, DDP
# torchrun --nproc_per_node=4 04_jigsaw_roberta_multilabel.py --model roberta-base --fold 0 1 2 3 4
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", default="data/train_folds.csv")
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--fold", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--out", default="runs/roberta_base")
    p.add_argument("--seed", type=int, default=2021)
    return p.parse_args()


class ToxicDataset(Dataset):
    def __init__(self, df, tok, max_len):
        self.text = df.comment_text.astype(str).tolist()
        self.y = df[LABELS].values.astype(np.float32)
        self.ids = np.arange(len(df))
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        enc = self.tok(self.text[i], max_length=self.max_len, truncation=True, padding="max_length",
                       return_tensors="pt")
        return {
            "input_ids": enc["input_ids"][0],
            "attention_mask": enc["attention_mask"][0],
            "y": torch.from_numpy(self.y[i]),
            "idx": torch.tensor(self.ids[i]),
        }


class ToxicModel(nn.Module):
    def __init__(self, name, n_out):
        super().__init__()
        self.roberta = AutoModel.from_pretrained(name)
        hidden = self.roberta.config.hidden_size
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(hidden, n_out)

    def forward(self, input_ids, attention_mask):
        out = self.roberta(input_ids=input_ids, attention_mask=attention_mask)
        last = out.last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(last.dtype)
        mean = (last * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.fc(self.drop(mean))


def gather_preds(idx, preds):
    world = dist.get_world_size()
    objs = [None] * world
    dist.all_gather_object(objs, (idx, preds))
    idx = np.concatenate([o[0] for o in objs])
    preds = np.concatenate([o[1] for o in objs])
    order = np.unique(idx, return_index=True)[1]
    return idx[order], preds[order]


@torch.no_grad()
def run_valid(model, loader, device):
    model.eval()
    ids, ps = [], []
    for b in loader:
        with torch.cuda.amp.autocast():
            logits = model(b["input_ids"].to(device), b["attention_mask"].to(device))
        ps.append(torch.sigmoid(logits.float()).cpu().numpy())
        ids.append(b["idx"].numpy())
    return gather_preds(np.concatenate(ids), np.concatenate(ps))


def mean_auc(y, p):
    return float(np.mean([roc_auc_score(y[:, k], p[:, k]) for k in range(y.shape[1])]))


def train_fold(fold, df, tok, args, rank, local_rank):
    device = torch.device("cuda", local_rank)
    tr = df[df.kfold != fold].reset_index(drop=True)
    va = df[df.kfold == fold].reset_index(drop=True)
    tr_ds, va_ds = ToxicDataset(tr, tok, args.max_len), ToxicDataset(va, tok, args.max_len)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, sampler=tr_sampler, num_workers=4, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, batch_size=args.bs * 2, sampler=va_sampler, num_workers=4, pin_memory=True)

    model = ToxicModel(args.model, len(LABELS)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(grouped, lr=args.lr)
    total = len(tr_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    best, best_oof = -1.0, None
    for ep in range(args.epochs):
        tr_sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for step, b in enumerate(tr_dl):
            with torch.cuda.amp.autocast():
                logits = model(b["input_ids"].to(device, non_blocking=True),
                               b["attention_mask"].to(device, non_blocking=True))
                loss = bce(logits, b["y"].to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            agg[0] += loss.detach()
            agg[1] += 1
            if rank == 0 and step % 200 == 0:
                print(f"  fold {fold} ep {ep} step {step}/{len(tr_dl)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(agg)

        idx, preds = run_valid(model, va_dl, device)
        auc = mean_auc(va[LABELS].values[idx], preds)
        if rank == 0:
            print(f"fold {fold} ep {ep} train {(agg[0] / agg[1]).item():.4f} val_auc {auc:.5f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            if auc > best:
                best = auc
                best_oof = va.loc[idx, ["id"]].copy()
                best_oof[LABELS] = preds
                torch.save(model.module.state_dict(), os.path.join(args.out, f"model_f{fold}.bin"))
        dist.barrier()
    return best, best_oof


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(args.train_csv)
    tok = AutoTokenizer.from_pretrained(args.model)
    results, oofs = {}, []
    for fold in args.fold:
        results[fold], oof = train_fold(fold, df, tok, args, rank, local_rank)
        oofs.append(oof)
        torch.cuda.empty_cache()

    if rank == 0:
        oof = pd.concat(oofs, ignore_index=True)
        oof.to_csv(os.path.join(args.out, "oof.csv"), index=False)
        gt = df.set_index("id").loc[oof.id, LABELS].values
        print("per fold:", {k: round(v, 5) for k, v in results.items()})
        print(f"OOF mean AUC {mean_auc(gt, oof[LABELS].values):.5f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
