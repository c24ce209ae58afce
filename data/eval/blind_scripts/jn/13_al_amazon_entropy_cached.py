"""Entropy-sampling active learning on Amazon review polarity (DistilRoBERTa).

The unlabelled pool is large (a few hundred thousand reviews), so the tokenised
pool is cached to disk once and re-used by later runs / rounds.

    torchrun --standalone --nproc_per_node=8 13_al_amazon_entropy_cached.py \
        --data_dir /data/amazon_review_polarity_csv --cache_dir /shared/cache/al_amazon \
        --output_dir /shared/al/amazon_entropy
"""
import argparse
import json
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--model_name", default="distilroberta-base")
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--pool_size", type=int, default=300_000)
    ap.add_argument("--init_size", type=int, default=500)
    ap.add_argument("--query_size", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


def load_or_build_cache(args, tokenizer):
    name = f"{os.path.basename(args.model_name)}_len{args.max_len}_n{args.pool_size}_s{args.seed}.pt"
    path = os.path.join(args.cache_dir, name)
    if os.path.exists(path):
        return torch.load(path)
    os.makedirs(args.cache_dir, exist_ok=True)
    cols = ["label", "title", "text"]
    train = pd.read_csv(os.path.join(args.data_dir, "train.csv"), names=cols, header=None)
    test = pd.read_csv(os.path.join(args.data_dir, "test.csv"), names=cols, header=None)
    train = train.sample(n=args.pool_size, random_state=args.seed).reset_index(drop=True)
    test = test.sample(n=20_000, random_state=args.seed).reset_index(drop=True)

    def encode(df):
        texts = (df["title"].fillna("") + ". " + df["text"].fillna("")).tolist()
        enc = tokenizer(texts, truncation=True, max_length=args.max_len, padding="max_length",
                        return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": torch.tensor(df["label"].values - 1)}

    data = {"pool": encode(train), "test": encode(test)}
    torch.save(data, path)
    return data


class TensorDict(Dataset):
    def __init__(self, d, idx=None):
        self.d = d
        self.idx = np.arange(len(d["labels"])) if idx is None else np.asarray(idx)

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = int(self.idx[i])
        item = {k: v[j] for k, v in self.d.items()}
        item["index"] = j
        return item


@torch.no_grad()
def predict(model, data, idx, device, batch=512):
    ds = TensorDict(data, idx)
    loader = DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds, shuffle=False), num_workers=2)
    model.eval()
    probs, ids = [], []
    for b in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
        probs.append(logits.float().softmax(-1))
        ids.append(b["index"].to(device))
    probs, ids = torch.cat(probs), torch.cat(ids)
    ws = dist.get_world_size()
    P = [torch.empty_like(probs) for _ in range(ws)]
    I = [torch.empty_like(ids) for _ in range(ws)]
    dist.all_gather(P, probs)
    dist.all_gather(I, ids)
    probs, ids = torch.cat(P), torch.cat(I)
    _, first = np.unique(ids.cpu().numpy(), return_index=True)
    first = torch.as_tensor(first, device=device)
    return probs[first], ids[first]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    data = load_or_build_cache(args, tokenizer)
    pool, test = data["pool"], data["test"]
    n_pool = len(pool["labels"])

    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(n_pool, args.init_size, replace=False))
    results = []
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for rnd in range(args.rounds):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=2).to(device)
        model = DDP(model, device_ids=[local_rank])
        train_ds = TensorDict(pool, labelled)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        steps = args.epochs * len(loader)
        sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.06 * steps), steps)
        scaler = torch.cuda.amp.GradScaler()

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for b in loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(input_ids=b["input_ids"].to(device),
                                attention_mask=b["attention_mask"].to(device),
                                labels=b["labels"].to(device))
                opt.zero_grad(set_to_none=True)
                scaler.scale(out.loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()

        t_probs, t_ids = predict(model.module, test, None, device)
        acc = (t_probs.argmax(-1).cpu() == test["labels"][t_ids.cpu()]).float().mean().item()

        unlabelled = np.setdiff1d(np.arange(n_pool), labelled)
        probs, ids = predict(model.module, pool, unlabelled, device)
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        top = ids[torch.topk(ent, min(args.query_size, len(ids))).indices].cpu().numpy()
        labelled = np.union1d(labelled, top)

        results.append({"round": rnd, "n_labelled": int(len(train_ds)), "test_acc": acc,
                        "mean_pool_entropy": ent.mean().item(), "seconds": time.time() - t0})
        if rank == 0:
            print(results[-1], flush=True)
            with open(os.path.join(args.output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
            torch.save({"labelled": torch.from_numpy(labelled)},
                       os.path.join(args.output_dir, f"labelled_round{rnd:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
