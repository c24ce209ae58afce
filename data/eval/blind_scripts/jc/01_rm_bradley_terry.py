#!/usr/bin/env python
"""Pairwise (Bradley-Terry) reward model training on a preference dataset, DDP.

Each example is {"prompt": ..., "chosen": ..., "rejected": ...}. Chosen and
rejected are put through the model in the same forward (first half / second
half of the batch) and trained with -log sigmoid(r_chosen - r_rejected).
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    get_cosine_schedule_with_warmup,
)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="EleutherAI/pythia-410m")
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", default="runs/rm")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


class PairwiseDataset(Dataset):
    def __init__(self, path, tokenizer, max_length):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                self.rows.append((ex["prompt"], ex["chosen"], ex["rejected"]))
        self.tok = tokenizer
        self.max_length = max_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        prompt, chosen, rejected = self.rows[idx]
        eos = self.tok.eos_token
        c = self.tok(prompt + chosen + eos, truncation=True, max_length=self.max_length)
        r = self.tok(prompt + rejected + eos, truncation=True, max_length=self.max_length)
        return c["input_ids"], r["input_ids"]


def make_collate(pad_id):
    def collate(batch):
        seqs = [c for c, _ in batch] + [r for _, r in batch]
        max_len = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), max_len), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        return ids, mask

    return collate


def pairwise_loss(rewards):
    r_chosen, r_rejected = rewards.chunk(2)
    loss = -F.logsigmoid(r_chosen - r_rejected)
    return loss, r_chosen, r_rejected


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    # loss sum, correct pairs, number of pairs, margin sum
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for ids, mask in loader:
        ids = ids.to(device, non_blocking=True)
        mask = mask.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        loss, r_c, r_r = pairwise_loss(rewards)
        stats[0] += loss.sum()
        stats[1] += (r_c > r_r).sum()
        stats[2] += r_c.numel()
        stats[3] += (r_c - r_r).sum()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    n = stats[2].item()
    return {
        "eval/loss": stats[0].item() / n,
        "eval/accuracy": stats[1].item() / n,
        "eval/margin": stats[3].item() / n,
    }


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    is_main = rank == 0

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "<|padding|>"})
    tokenizer.padding_side = "right"

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=1)
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_ds = PairwiseDataset(args.train_file, tokenizer, args.max_length)
    eval_ds = PairwiseDataset(args.eval_file, tokenizer, args.max_length)
    collate = make_collate(tokenizer.pad_token_id)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(
        train_ds,
        batch_size=args.batch_size,
        sampler=train_sampler,
        collate_fn=collate,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
    )
    # every rank scores a disjoint slice of the eval set, no padding duplicates
    eval_shard = Subset(eval_ds, list(range(rank, len(eval_ds), world_size)))
    eval_loader = DataLoader(eval_shard, batch_size=args.batch_size * 2, collate_fn=collate, num_workers=2)

    no_decay = ["bias", "LayerNorm.weight", "layernorm", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    total_steps = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * total_steps), total_steps
    )

    writer = None
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        print(f"train pairs={len(train_ds)} eval pairs={len(eval_ds)} world={world_size} "
              f"steps/epoch={len(train_loader)}")

    step = 0
    best_acc = -1.0
    t0 = time.time()
    model.train()
    for epoch in range(args.epochs):
        running = torch.zeros(3, device=device)
        for ids, mask in train_loader:
            ids = ids.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                rewards = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
            loss, r_c, r_r = pairwise_loss(rewards)
            loss = loss.mean()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1

            running[0] += loss.detach()
            running[1] += (r_c > r_r).float().mean()
            running[2] += 1
            if step % args.log_every == 0:
                dist.all_reduce(running)
                avg_loss = (running[0] / running[2]).item()
                avg_acc = (running[1] / running[2]).item()
                if is_main:
                    elapsed = time.time() - t0
                    print(f"epoch {epoch} step {step}/{total_steps} loss {avg_loss:.4f} "
                          f"acc {avg_acc:.3f} lr {scheduler.get_last_lr()[0]:.2e} {elapsed:.0f}s")
                    writer.add_scalar("train/loss", avg_loss, step)
                    writer.add_scalar("train/accuracy", avg_acc, step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                running.zero_()

        metrics = evaluate(model.module, eval_loader, device)
        if is_main:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            if metrics["eval/accuracy"] > best_acc:
                best_acc = metrics["eval/accuracy"]
                save_dir = os.path.join(args.output_dir, "best")
                model.module.save_pretrained(save_dir)
                tokenizer.save_pretrained(save_dir)
                with open(os.path.join(save_dir, "eval.json"), "w") as f:
                    json.dump({"epoch": epoch, "step": step, **metrics}, f, indent=2)
        dist.barrier()

    if is_main:
        final_dir = os.path.join(args.output_dir, "final")
        model.module.save_pretrained(final_dir)
        tokenizer.save_pretrained(final_dir)
        writer.close()
        print(f"done, best eval accuracy {best_acc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
