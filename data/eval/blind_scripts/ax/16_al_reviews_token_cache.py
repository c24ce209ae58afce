"""Least-confidence active learning on Amazon review polarity (DistilBERT).

The pool is large (3.6M reviews), so it is tokenised once into a tensor cache
next to the CSV files and reused by later runs and rounds.

    torchrun --nproc_per_node=8 al_reviews_token_cache.py \
        --data-dir /data/amazon_review_polarity --rounds 6 --query 5000
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

logger = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--model", default="distilbert-base-uncased")
    p.add_argument("--output-dir", default="al_reviews")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--init", type=int, default=2000)
    p.add_argument("--query", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pool-sample", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_split(data_dir, split, tok, max_len):
    """Tokenised split as a TensorDataset; cached as <split>.<model>.<len>.pt."""
    cache = os.path.join(data_dir, f"{split}.{tok.name_or_path.replace('/', '_')}.{max_len}.pt")
    if os.path.exists(cache):
        ids, mask, labels = torch.load(cache)
    else:
        df = pd.read_csv(os.path.join(data_dir, f"{split}.csv"), header=None,
                         names=["label", "title", "text"])
        texts = (df["title"].fillna("") + ". " + df["text"].fillna("")).tolist()
        enc = tok(texts, truncation=True, max_length=max_len, padding="max_length",
                  return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        labels = torch.tensor(df["label"].values - 1)
        torch.save((ids, mask, labels), cache)
    return TensorDataset(ids, mask, labels)


@torch.no_grad()
def least_confidence(net, dataset, device, world):
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=512, sampler=sampler, num_workers=2)
    pos = torch.tensor(list(sampler), device=device)
    net.eval()
    conf = []
    for ids, mask, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        conf.append(logits.float().softmax(-1).max(-1).values)
    conf = torch.cat(conf)
    all_pos = [torch.empty_like(pos) for _ in range(world)]
    all_conf = [torch.empty_like(conf) for _ in range(world)]
    dist.all_gather(all_pos, pos)
    dist.all_gather(all_conf, conf)
    out = torch.ones(len(dataset), device=device)
    out[torch.cat(all_pos)] = torch.cat(all_conf)
    return out.cpu()


@torch.no_grad()
def accuracy(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for ids, mask, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        s[0] += (logits.argmax(-1) == y.to(device)).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = load_split(args.data_dir, "train", tok, args.max_len)
    test_ds = load_split(args.data_dir, "test", tok, args.max_len)
    logger.info("train %d / test %d examples", len(train_ds), len(test_ds))
    test_loader = DataLoader(test_ds, batch_size=512, num_workers=2,
                             sampler=DistributedSampler(test_ds, shuffle=False))

    rng = np.random.default_rng(args.seed)
    labeled = rng.choice(len(train_ds), args.init, replace=False)
    unlabeled = np.setdiff1d(np.arange(len(train_ds)), labeled)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        net = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
        model = DDP(net, device_ids=[local_rank])
        lab = Subset(train_ds, labeled.tolist())
        sampler = DistributedSampler(lab, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(lab, batch_size=args.bs, sampler=sampler, num_workers=2,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        scaler = torch.cuda.amp.GradScaler()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for ids, mask, y in loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                    loss = F.cross_entropy(logits.float(), y.to(device))
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
        acc = accuracy(net, test_loader, device)
        logger.info("round %d | labeled %d | acc %.4f | %.0fs", rnd, len(labeled), acc, time.time() - t0)
        if rank == 0:
            net.save_pretrained(os.path.join(args.output_dir, f"round_{rnd}"))
            np.save(os.path.join(args.output_dir, f"labeled_{rnd}.npy"), labeled)
        if rnd == args.rounds:
            break

        cand = rng.choice(unlabeled, min(args.pool_sample, len(unlabeled)), replace=False)
        conf = least_confidence(net, Subset(train_ds, cand.tolist()), device, world)
        picked = cand[torch.argsort(conf)[: args.query].numpy()]
        labeled = np.concatenate([labeled, picked])
        unlabeled = np.setdiff1d(unlabeled, picked)
        dist.barrier()
        del model, net, opt

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
