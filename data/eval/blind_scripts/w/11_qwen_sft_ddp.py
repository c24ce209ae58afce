"""
Supervised fine-tuning of Qwen2.5-0.5B on an instruction dataset (Alpaca-style JSON),
plain PyTorch + DDP, bf16 autocast. Only the response tokens are trained on.

    torchrun --nproc_per_node=8 11_qwen_sft_ddp.py --data data/alpaca_cleaned.json --epochs 2
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    ap.add_argument("--data", default="data/alpaca_cleaned.json")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.03)
    ap.add_argument("--val_size", type=int, default=1000)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--output_dir", default="qwen-sft")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class SFTDataset(Dataset):
    def __init__(self, records, tokenizer, max_len):
        self.records, self.tok, self.max_len = records, tokenizer, max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        input_block = f"### Input:\n{r['input']}\n\n" if r.get("input") else ""
        prompt = PROMPT.format(instruction=r["instruction"], input_block=input_block)
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = self.tok(r["output"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(p_ids) + a_ids)[: self.max_len]
        return {"input_ids": ids, "labels": labels}


def make_collate(pad_id):
    def collate(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), L), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return collate


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        if n_tok > 0:
            acc += torch.stack([loss.float() * n_tok, n_tok.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    with open(args.data) as f:
        records = json.load(f)
    random.Random(args.seed).shuffle(records)  # same seed -> same split on every rank
    val_records, train_records = records[: args.val_size], records[args.val_size:]
    train_ds = SFTDataset(train_records, tokenizer, args.max_len)
    val_ds = SFTDataset(val_records, tokenizer, args.max_len)

    collate = make_collate(tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.batch_size, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"train {len(train_ds)} | val {len(val_ds)} | {total_steps} steps | global batch {args.batch_size * world}")

    step, best_val, skipped = 0, float("inf"), 0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss

            # a few samples have the whole response truncated away -> loss is nan, skip them
            if not torch.isfinite(loss):
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue

            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    el = time.time() - t0
                    print(f"ep {epoch} step {step}/{total_steps} loss {l.item():.4f} gnorm {gnorm:.2f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} skipped {skipped} ({el:.0f}s)")

        val_loss = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch}: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f})")
            if val_loss < best_val:
                best_val = val_loss
                model.module.save_pretrained(os.path.join(args.output_dir, "best"), safe_serialization=True)
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
