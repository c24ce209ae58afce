"""Pairwise reward model training (Bradley-Terry) for RLHF.

Input: JSONL files with {"prompt": ..., "chosen": ..., "rejected": ...}.
The reward model is a causal LM backbone with a scalar head; chosen and
rejected sequences go through one forward together.

torchrun --nproc_per_node=8 train_rm.py --model EleutherAI/pythia-1.4b \
    --train data/hh_rlhf/train.jsonl --val data/hh_rlhf/test.jsonl --out rm_pythia1.4b
"""
import argparse
import hashlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="EleutherAI/pythia-1.4b")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--cache_dir", default=".cache/rm_tokenized")
    p.add_argument("--out", default="rm_out")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8, help="pairs per GPU")
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval_every", type=int, default=500)
    return p.parse_args()


def tokenize_pairs(path, tokenizer, max_len, cache_dir):
    key = hashlib.md5(f"{os.path.abspath(path)}|{tokenizer.name_or_path}|{max_len}".encode()).hexdigest()[:12]
    cache = os.path.join(cache_dir, f"{os.path.basename(path)}.{key}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)

    examples = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            c = tokenizer(row["prompt"] + row["chosen"] + tokenizer.eos_token, truncation=True, max_length=max_len)
            r = tokenizer(row["prompt"] + row["rejected"] + tokenizer.eos_token, truncation=True, max_length=max_len)
            if c["input_ids"] == r["input_ids"]:
                continue
            examples.append({"chosen": c["input_ids"], "rejected": r["input_ids"]})
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache, "w") as f:
        json.dump(examples, f)
    return examples


class PairDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return i, self.examples[i]


def make_collate(pad_id):
    def collate(batch):
        idx = torch.tensor([b[0] for b in batch])
        seqs = [b[1]["chosen"] for b in batch] + [b[1]["rejected"] for b in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for k, s in enumerate(seqs):
            ids[k, :len(s)] = torch.tensor(s)  # right padding; the head reads the last non-pad token
            mask[k, :len(s)] = 1
        return idx, ids, mask
    return collate


@torch.no_grad()
def evaluate(model, loader, device, rank, world):
    model.eval()
    local = []
    for idx, ids, mask in loader:
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        rc, rr = rewards.chunk(2)
        local.extend(zip(idx.tolist(), (rc > rr).tolist(), (rc - rr).tolist()))
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    if rank != 0:
        return None
    uniq = {i: (c, m) for part in gathered for i, c, m in part}  # sampler padding repeats a few indices
    acc = sum(c for c, _ in uniq.values()) / len(uniq)
    margin = sum(m for _, m in uniq.values()) / len(uniq)
    return acc, margin


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    train_ex = tokenize_pairs(args.train, tokenizer, args.max_len, args.cache_dir)
    val_ex = tokenize_pairs(args.val, tokenizer, args.max_len, args.cache_dir)
    if rank == 0:
        print(f"{len(train_ex)} train pairs, {len(val_ex)} val pairs")

    collate = make_collate(tokenizer.pad_token_id)
    train_ds, val_ds = PairDataset(train_ex), PairDataset(val_ex)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, collate_fn=collate,
                            sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    updates = args.epochs * len(train_loader) // args.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * updates), updates)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (_, ids, mask) in enumerate(train_loader):
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            sync = (it + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
                rc, rr = rewards.chunk(2)
                loss = -F.logsigmoid(rc - rr).mean()
                (loss / args.grad_accum).backward()
            if not sync:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                stats = torch.stack([loss.detach(), (rc > rr).float().mean().detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{updates} loss {stats[0]:.4f} acc {stats[1]:.3f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / step:.2f}s/step", flush=True)

            if step % args.eval_every == 0:
                res = evaluate(model, val_loader, device, rank, world)
                if rank == 0:
                    print(f"[eval] step {step} acc {res[0]:.4f} margin {res[1]:.3f}", flush=True)

    res = evaluate(model, val_loader, device, rank, world)
    if rank == 0:
        print(f"[final] acc {res[0]:.4f} margin {res[1]:.3f}")
        model.module.save_pretrained(args.out, safe_serialization=True)
        tokenizer.save_pretrained(args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
