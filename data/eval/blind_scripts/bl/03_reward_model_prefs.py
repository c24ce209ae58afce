"""Train a pairwise (Bradley-Terry) reward model for RLHF on preference data.

Input: a JSONL file with one {"prompt", "chosen", "rejected"} record per line.

    torchrun --nproc_per_node=8 03_reward_model_prefs.py \
        --data data/hh_prefs.jsonl --model EleutherAI/pythia-410m --out rm-pythia-410m
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="EleutherAI/pythia-410m")
    ap.add_argument("--out", default="rm-out")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per GPU")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bf16", action="store_true")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_pairs(path):
    pairs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            ex = json.loads(line)
            if ex["chosen"] == ex["rejected"]:
                continue
            pairs.append(ex)
    return pairs


class PairDataset(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        ex = self.pairs[i]
        return ex["prompt"] + ex["chosen"], ex["prompt"] + ex["rejected"]


class PairCollator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        chosen, rejected = zip(*batch)
        enc = self.tok(list(chosen) + list(rejected), padding=True, truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]


def pairwise_loss(model, input_ids, attention_mask):
    rewards = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)
    r_chosen, r_rejected = rewards.chunk(2)
    loss = -F.logsigmoid(r_chosen - r_rejected).mean()
    correct = (r_chosen > r_rejected).float().sum()
    return loss, correct, r_chosen.shape[0]


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype):
    model.eval()
    totals = torch.zeros(3, device=device)  # loss_sum, correct, n
    for input_ids, attn in loader:
        input_ids, attn = input_ids.to(device), attn.to(device)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
            loss, correct, n = pairwise_loss(model, input_ids, attn)
        totals += torch.tensor([loss.item() * n, correct.item(), n], device=device)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"

    pairs = load_pairs(args.data)
    random.shuffle(pairs)
    n_val = max(1, int(len(pairs) * args.val_frac))
    val_pairs, train_pairs = pairs[:n_val], pairs[n_val:]
    if rank == 0:
        print(f"{len(train_pairs)} train pairs, {len(val_pairs)} val pairs, world size {world}")

    collate = PairCollator(tok, args.max_len)
    train_ds, val_ds = PairDataset(train_pairs), PairDataset(val_pairs)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    # strided shard of the validation pairs, no padding, so every pair is counted exactly once
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ["bias", "LayerNorm.weight", "layernorm", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    amp_dtype = torch.bfloat16 if args.bf16 else None

    step = 0
    best_acc = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (input_ids, attn) in enumerate(train_loader):
            input_ids, attn = input_ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
            sync = (i + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss, correct, n = pairwise_loss(model, input_ids, attn)
                (loss / args.grad_accum).backward()
            if not sync:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"acc {correct.item() / n:.3f} lr {scheduler.get_last_lr()[0]:.2e}")

            if step % args.eval_every == 0 or step == total_steps:
                val_loss, val_acc = evaluate(model.module, val_loader, device, amp_dtype)
                if rank == 0:
                    print(f"[eval] step {step} val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
                    if val_acc > best_acc:
                        best_acc = val_acc
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
        print(f"done, best val acc {best_acc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
