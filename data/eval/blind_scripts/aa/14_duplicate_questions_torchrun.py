"""Duplicate-question detection (cross-encoder on MiniLM), grouped split so no question leaks.

    torchrun --nproc_per_node=4 14_duplicate_questions_torchrun.py --pairs data/question_pairs.tsv \
        --out runs/dupq_minilm
"""
import argparse
import json
import os
import random

import networkx as nx
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.model_selection import GroupShuffleSplit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", required=True, help="tsv with qid1, qid2, question1, question2, is_duplicate")
    parser.add_argument("--out", default="runs/dupq_minilm")
    parser.add_argument("--model", default="microsoft/MiniLM-L12-H384-uncased")
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--seed", type=int, default=99)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def connected_groups(df):
    """Questions linked by any pair share a group, so a split by group cannot leak a question."""
    g = nx.Graph()
    g.add_edges_from(zip(df["qid1"], df["qid2"]))
    comp_of = {}
    for cid, comp in enumerate(sorted(nx.connected_components(g), key=lambda c: min(c))):
        for q in comp:
            comp_of[q] = cid
    return df["qid1"].map(comp_of).values


class PairDataset(Dataset):
    def __init__(self, df, tokenizer, max_len):
        self.enc = tokenizer(df["question1"].tolist(), df["question2"].tolist(), truncation=True,
                             max_length=max_len, padding="max_length")
        self.labels = df["is_duplicate"].astype(int).tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        item = {k: torch.tensor(v[i]) for k, v in self.enc.items()}
        item["labels"] = torch.tensor(self.labels[i])
        return item


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(5, device=device)  # loss*n, n, tp, fp, fn
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(**batch)
        pred, y = out.logits.argmax(-1), batch["labels"]
        s[0] += out.loss.float() * y.numel()
        s[1] += y.numel()
        s[2] += ((pred == 1) & (y == 1)).sum()
        s[3] += ((pred == 1) & (y == 0)).sum()
        s[4] += ((pred == 0) & (y == 1)).sum()
    dist.all_reduce(s)
    f1 = (2 * s[2] / (2 * s[2] + s[3] + s[4]).clamp(min=1)).item()
    return {"loss": (s[0] / s[1]).item(), "f1": f1}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.pairs, sep="\t", quoting=3, on_bad_lines="skip")
    df = df.dropna(subset=["question1", "question2"])
    df = df[(df["question1"].str.len() > 5) & (df["question2"].str.len() > 5)].reset_index(drop=True)
    groups = connected_groups(df)
    gss = GroupShuffleSplit(n_splits=1, test_size=0.1, random_state=args.seed)
    tr_idx, va_idx = next(gss.split(df, df["is_duplicate"], groups))
    if rank == 0:
        print(f"pairs: train {len(tr_idx)} val {len(va_idx)} | dup rate {df['is_duplicate'].mean():.3f}", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = PairDataset(df.iloc[tr_idx], tokenizer, args.max_len)
    val_ds = PairDataset(df.iloc[va_idx], tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    lr = args.lr * world_size ** 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.out, exist_ok=True)
    best_f1, patience_left, history = 0.0, args.patience, []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_dl, device)
        history.append({"epoch": epoch, **metrics})
        if rank == 0:
            print(f"epoch {epoch} val {metrics}", flush=True)
        if metrics["f1"] > best_f1:
            best_f1, patience_left = metrics["f1"], args.patience
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
        else:
            patience_left -= 1
            if patience_left == 0:
                break

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
