"""Feedback Prize - English Language Learning. DeBERTa-v3 mean-pool regressor, 4-fold, DDP.

torchrun --standalone --nproc_per_node=4 02_ell_deberta_regression.py --config cfg_base.yaml
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, DataCollatorWithPadding, get_cosine_schedule_with_warmup

TARGETS = ["cohesion", "syntax", "vocabulary", "phraseology", "grammar", "conventions"]

DEFAULTS = dict(
    model_name="microsoft/deberta-v3-base", data_dir="/data/ell", out_dir="./outputs/deb_base",
    max_len=768, n_folds=4, epochs=4, global_batch_size=32, accum=2, lr=2e-5, head_lr=1e-3,
    weight_decay=0.01, warmup_ratio=0.1, patience=2, num_workers=4, seed=42, wandb_project="ell",
)


def load_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("--no-wandb", action="store_true")
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["use_wandb"] = not a.no_wandb
    return argparse.Namespace(**cfg)


def build_token_cache(cfg, tokenizer, rank):
    cache = os.path.join(cfg.out_dir, f"tokens_{cfg.model_name.split('/')[-1]}_{cfg.max_len}.pt")
    if rank == 0 and not os.path.exists(cache):
        df = pd.read_csv(os.path.join(cfg.data_dir, "train_folds.csv"))
        enc = tokenizer(df["full_text"].tolist(), truncation=True, max_length=cfg.max_len)
        tmp = cache + ".tmp"
        torch.save({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, tmp)
        os.replace(tmp, cache)
    dist.barrier()
    return torch.load(cache)


class EssayDataset(Dataset):
    def __init__(self, idx, enc, labels):
        self.idx = idx
        self.enc = enc
        self.labels = labels

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = self.idx[i]
        return {"input_ids": self.enc["input_ids"][j], "attention_mask": self.enc["attention_mask"][j],
                "labels": self.labels[j].tolist(), "row": int(j)}


class Collate:
    def __init__(self, tokenizer):
        self.pad = DataCollatorWithPadding(tokenizer)

    def __call__(self, batch):
        labels = torch.tensor([b.pop("labels") for b in batch], dtype=torch.float32)
        rows = torch.tensor([b.pop("row") for b in batch])
        out = self.pad(batch)
        out["labels"], out["rows"] = labels, rows
        return out


class MeanPoolRegressor(nn.Module):
    def __init__(self, name):
        super().__init__()
        config = AutoConfig.from_pretrained(name)
        config.update({"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
        self.backbone = AutoModel.from_pretrained(name, config=config)
        self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.head = nn.Linear(config.hidden_size, len(TARGETS))

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-6)
        return self.head(pooled)


def mcrmse(y_true, y_pred):
    return float(np.mean(np.sqrt(np.mean((y_true - y_pred) ** 2, axis=0))))


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    rows, preds = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        preds.append(out.float().cpu().numpy())
        rows.append(batch["rows"].numpy())
    local = (np.concatenate(rows), np.concatenate(preds))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    rows = np.concatenate([g[0] for g in gathered])
    preds = np.concatenate([g[1] for g in gathered])
    # DistributedSampler pads the last shard by repeating rows; keep each row once
    _, first = np.unique(rows, return_index=True)
    return rows[first], preds[first]


def run_fold(fold, cfg, df, enc, tokenizer, rank, world, device, local_rank):
    labels = df[TARGETS].values.astype(np.float32)
    tr_idx = np.where(df.fold != fold)[0]
    va_idx = np.where(df.fold == fold)[0]
    per_gpu = cfg.global_batch_size // (world * cfg.accum)
    collate = Collate(tokenizer)
    tr_ds, va_ds = EssayDataset(tr_idx, enc, labels), EssayDataset(va_idx, enc, labels)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_loader = DataLoader(tr_ds, batch_size=per_gpu, sampler=tr_sampler, collate_fn=collate,
                           num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    va_loader = DataLoader(va_ds, batch_size=per_gpu * 4, sampler=va_sampler, collate_fn=collate,
                           num_workers=cfg.num_workers)

    torch.manual_seed(cfg.seed + fold)
    model = MeanPoolRegressor(cfg.model_name).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [
        {"params": model.module.backbone.parameters(), "lr": cfg.lr},
        {"params": model.module.head.parameters(), "lr": cfg.head_lr},
    ]
    optimizer = torch.optim.AdamW(params, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(tr_loader) / cfg.accum)
    total = steps_per_epoch * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    loss_fn = nn.SmoothL1Loss()

    best, bad_epochs, best_oof = float("inf"), 0, None
    ckpt = os.path.join(cfg.out_dir, f"fold{fold}.pt")
    for epoch in range(cfg.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0, run_loss = time.time(), torch.zeros(2, device=device)
        for step, batch in enumerate(tr_loader):
            sync = (step + 1) % cfg.accum == 0 or (step + 1) == len(tr_loader)
            ctx = nullcontext() if sync else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
                loss = loss_fn(out.float(), batch["labels"].to(device))
                (loss / cfg.accum).backward()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(run_loss)
        rows, preds = predict(model.module, va_loader, device)
        score = mcrmse(labels[rows], preds)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            train_loss = (run_loss[0] / run_loss[1]).item()
            print(f"[fold {fold}] ep {epoch} loss {train_loss:.4f} mcrmse {score:.4f} ({time.time() - t0:.0f}s)")
            if cfg.use_wandb:
                wandb.log({f"f{fold}/train_loss": train_loss, f"f{fold}/mcrmse": score, "epoch": epoch})
            if score < best:
                best, bad_epochs = score, 0
                best_oof = pd.DataFrame(preds, columns=TARGETS).assign(text_id=df.text_id.values[rows])
                torch.save(model.module.state_dict(), ckpt)
            else:
                bad_epochs += 1
                if bad_epochs >= cfg.patience:
                    stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break
    dist.barrier()
    return best, best_oof


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert cfg.global_batch_size % (world * cfg.accum) == 0, "global batch must split over gpus x accum"

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=2)
        if cfg.use_wandb:
            wandb.init(project=cfg.wandb_project, config=vars(cfg), name=os.path.basename(cfg.out_dir))
    dist.barrier()

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    df = pd.read_csv(os.path.join(cfg.data_dir, "train_folds.csv"))
    enc = build_token_cache(cfg, tokenizer, rank)

    scores, oofs = [], []
    for fold in range(cfg.n_folds):
        s, oof = run_fold(fold, cfg, df, enc, tokenizer, rank, world, device, local_rank)
        scores.append(s)
        oofs.append(oof)
        torch.cuda.empty_cache()

    if rank == 0:
        oof = pd.concat(oofs).reset_index(drop=True)
        oof.to_csv(os.path.join(cfg.out_dir, "oof.csv"), index=False)
        merged = oof.merge(df[["text_id"] + TARGETS], on="text_id", suffixes=("_pred", ""))
        cv = mcrmse(merged[TARGETS].values, merged[[t + "_pred" for t in TARGETS]].values)
        print(f"fold scores {np.round(scores, 4)}  CV {cv:.4f}")
        if cfg.use_wandb:
            wandb.summary["cv"] = cv
            wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
