"""
Reward model training on a mix of preference datasets (HH-RLHF + SHP + UltraFeedback).

Tokenisation of ~500k pairs takes a while, so the tokenised pairs are cached
next to the data and reused by later runs.

    torchrun --nproc_per_node=8 16_rm_pref_mixture.py --base EleutherAI/pythia-1.4b-deduped
"""
import argparse
import hashlib
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_scheduler

SOURCES = {
    "hh": ("Anthropic/hh-rlhf", None),
    "shp": ("stanfordnlp/SHP", None),
    "uf": ("HuggingFaceH4/ultrafeedback_binarized", None),
}


def extract(name, ex):
    if name == "hh":
        return ex["chosen"], ex["rejected"]
    if name == "shp":
        a = ex["history"] + "\n\n" + ex["human_ref_A"]
        b = ex["history"] + "\n\n" + ex["human_ref_B"]
        return (a, b) if ex["labels"] == 1 else (b, a)
    conv = lambda msgs: "\n\n".join(f"{m['role']}: {m['content']}" for m in msgs)
    return conv(ex["chosen"]), conv(ex["rejected"])


def tokenize_all(tok, max_len, split):
    pairs = []
    for name, (hub_id, cfg) in SOURCES.items():
        sp = split if name != "uf" else ("train_prefs" if split == "train" else "test_prefs")
        ds = load_dataset(hub_id, cfg, split=sp)
        for ex in ds:
            c, r = extract(name, ex)
            ci = tok(c, truncation=True, max_length=max_len)["input_ids"]
            ri = tok(r, truncation=True, max_length=max_len)["input_ids"]
            if ci != ri:
                pairs.append((ci, ri))
    return pairs


def load_pairs(tok, max_len, split, cache_dir):
    key = hashlib.md5(f"{tok.name_or_path}-{max_len}-{split}-{sorted(SOURCES)}".encode()).hexdigest()[:10]
    path = os.path.join(cache_dir, f"pairs_{split}_{key}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    pairs = tokenize_all(tok, max_len, split)
    os.makedirs(cache_dir, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(pairs, f, protocol=pickle.HIGHEST_PROTOCOL)
    return pairs


class PairDataset(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


class PadPairs:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [c for c, _ in batch] + [r for _, r in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        m = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            m[i, :len(s)] = 1
        return ids, m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="EleutherAI/pythia-1.4b-deduped")
    ap.add_argument("--cache_dir", default="/data/rm_cache")
    ap.add_argument("--out", default="/data/rm_runs/pythia1.4b_mix")
    ap.add_argument("--max_len", type=int, default=768)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = "<|padding|>"
    t = time.time()
    train_pairs = load_pairs(tok, args.max_len, "train", args.cache_dir)
    test_pairs = load_pairs(tok, args.max_len, "test", args.cache_dir)
    if rank == 0:
        print(f"loaded {len(train_pairs)} train / {len(test_pairs)} test pairs in {time.time() - t:.0f}s", flush=True)

    train_ds = PairDataset(train_pairs)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    collate = PadPairs(tok.pad_token_id)
    loader = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(PairDataset(test_pairs[rank::world]), batch_size=args.bsz * 2, collate_fn=collate)

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(loader)
    sched = get_scheduler("cosine", opt, num_warmup_steps=int(0.05 * total), num_training_steps=total)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for ids, m in loader:
            ids, m = ids.to(device, non_blocking=True), m.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                r = model(input_ids=ids, attention_mask=m).logits.squeeze(-1)
            rc, rr = r.float().chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                st = torch.stack([loss.detach(), (rc > rr).float().mean()])
                dist.all_reduce(st, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {st[0]:.4f} acc {st[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        tally = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, m in test_loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    r = model.module(input_ids=ids.to(device), attention_mask=m.to(device)).logits.squeeze(-1)
                rc, rr = r.float().chunk(2)
                tally[0] += (rc > rr).sum()
                tally[1] += rc.numel()
        dist.all_reduce(tally)
        if rank == 0:
            print(f"epoch {epoch} test acc {(tally[0] / tally[1]).item():.4f}", flush=True)
            d = os.path.join(args.out, f"epoch{epoch}")
            model.module.save_pretrained(d)
            tok.save_pretrained(d)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
