"""Automated essay scoring (regression on 1-6 holistic score) with DeBERTa-v3-base, logged to W&B.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_essay_scoring_wandb.py --csv /mnt/shared/essays/train.csv --out /mnt/shared/runs/aes_debv3
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from sklearn.metrics import cohen_kappa_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backbone", default="microsoft/deberta-v3-base")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5, help="tuned for the 2x8 GPU global batch of 128")
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--project", default="essay-scoring")
    return p.parse_args()


class EssayDataset(Dataset):
    def __init__(self, df, tok, max_len):
        self.texts = df["full_text"].tolist()
        self.scores = df["score"].astype(np.float32).tolist()
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        return enc["input_ids"], self.scores[i]


def make_collate(pad_id):
    def collate(batch):
        ids, ys = zip(*batch)
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), L), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        return input_ids, mask, torch.tensor(ys)
    return collate


class Scorer(nn.Module):
    def __init__(self, name):
        super().__init__()
        cfg = AutoConfig.from_pretrained(name)
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
        self.backbone = AutoModel.from_pretrained(name, config=cfg)
        self.head = nn.Linear(cfg.hidden_size, 1)

    def forward(self, ids, mask):
        h = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1)).squeeze(-1)


def qwk(y_true, y_pred):
    return cohen_kappa_score(np.asarray(y_true).astype(int), np.clip(np.rint(y_pred), 1, 6).astype(int),
                             weights="quadratic")


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    run = wandb.init(project=args.project, name=f"debv3-fold{args.fold}", config=vars(args))

    df = pd.read_csv(args.csv)
    df = df[df["full_text"].str.len() > 50].reset_index(drop=True)
    skf = StratifiedKFold(n_splits=args.n_folds, shuffle=True, random_state=42)
    tr_idx, va_idx = list(skf.split(df, df["score"]))[args.fold]

    tok = AutoTokenizer.from_pretrained(args.backbone)
    train_ds = EssayDataset(df.iloc[tr_idx], tok, args.max_len)
    val_ds = EssayDataset(df.iloc[va_idx], tok, args.max_len)
    collate = make_collate(tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                          drop_last=True)
    # unpadded strided shard per rank; predictions are gathered before scoring
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=16,
                        collate_fn=collate, num_workers=2)

    model = Scorer(args.backbone).to(dev)
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.backbone.parameters(), "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    updates = len(train_dl) // args.accum * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.1 * updates), updates)

    os.makedirs(args.out, exist_ok=True)
    best, gstep = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.to(dev), mask.to(dev), y.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(ids, mask)
            loss = nn.functional.smooth_l1_loss(pred.float(), y) / args.accum
            loss.backward()
            if (i + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                gstep += 1
                wandb.log({"train/loss": loss.item() * args.accum, "train/lr": scheduler.get_last_lr()[0],
                           "epoch": epoch}, step=gstep)

        model.eval()
        preds, ys = [], []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for ids, mask, y in val_dl:
                preds.append(model.module(ids.to(dev), mask.to(dev)).float().cpu().numpy())
                ys.append(y.numpy())
        shards = [None] * world
        dist.all_gather_object(shards, (np.concatenate(preds), np.concatenate(ys)))
        all_p = np.concatenate([s[0] for s in shards])
        all_y = np.concatenate([s[1] for s in shards])
        score = qwk(all_y, all_p)
        rmse = float(np.sqrt(np.mean((all_p - all_y) ** 2)))
        wandb.log({"val/qwk": score, "val/rmse": rmse, "epoch_time_s": time.time() - t0}, step=gstep)
        if rank == 0:
            print(f"epoch {epoch}: qwk {score:.4f} rmse {rmse:.4f}", flush=True)
            if score > best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{args.fold}_best.pt"))
                np.save(os.path.join(args.out, f"fold{args.fold}_oof.npy"), np.stack([all_y, all_p]))
        dist.barrier()

    run.summary["best_qwk"] = best
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
