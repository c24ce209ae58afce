"""Supervised fine-tuning of a causal LM with DDP + torch.compile and length buckets.

Every batch is right-padded up to the next bucket length and the sequence
dimension is marked dynamic, so Dynamo compiles one graph for all buckets
instead of one graph per length.

    torchrun --nproc_per_node=8 sft_bucketed_compile.py \
        --model Qwen/Qwen2.5-1.5B --train data/sft_train.jsonl --val data/sft_val.jsonl --out runs/sft
"""
import argparse
import functools
import json
import math
import os
import random

import torch
import torch.distributed as dist
import torch._dynamo
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

BUCKETS = [256, 512, 1024, 2048]
IGNORE = -100


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok = tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = self.tok.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = self.tok(row["response"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = p_ids + r_ids
        labels = [IGNORE] * len(p_ids) + r_ids
        return torch.tensor(ids), torch.tensor(labels)


def pad_to_bucket(batch, pad_id):
    longest = max(ids.numel() for ids, _ in batch)
    length = next((b for b in BUCKETS if b >= longest), longest)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(batch), length), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        n = ids.numel()
        input_ids[i, :n] = ids
        labels[i, :n] = lab
        attn[i, :n] = 1
    return input_ids, labels, attn


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--per-device-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)
    for input_ids, labels, attn in loader:
        input_ids, labels, attn = input_ids.to(device), labels.to(device), attn.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=input_ids, attention_mask=attn)
        logits = out.logits[:, :-1].float()
        tgt = labels[:, 1:]
        sums[0] += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        sums[1] += (tgt != IGNORE).sum()
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    collate = functools.partial(pad_to_bucket, pad_id=tokenizer.pad_token_id)

    train_ds = SFTDataset(args.train, tokenizer)
    val_ds = SFTDataset(args.val, tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.per_device_batch, sampler=val_sampler,
                        collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    raw_model = model

    model = DDP(model, device_ids=[local_rank])
    torch._dynamo.config.cache_size_limit = 32
    model = torch.compile(model)

    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    step = 0
    best = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for input_ids, labels, attn in train_dl:
            if input_ids.size(1) > BUCKETS[-1]:
                # a length past the last bucket means a fresh compile and usually an OOM
                continue
            input_ids = input_ids.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            torch._dynamo.mark_dynamic(input_ids, 1)
            torch._dynamo.mark_dynamic(labels, 1)
            torch._dynamo.mark_dynamic(attn, 1)

            out = model(input_ids=input_ids, attention_mask=attn, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                loss = out.loss.detach()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} len {input_ids.size(1)}", flush=True)

        val_loss = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
            if val_loss < best:
                best = val_loss
                raw_model.save_pretrained(os.path.join(args.out, "best"), safe_serialization=True)
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    if rank == 0:
        raw_model.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
