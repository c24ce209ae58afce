"""
Fine-tune GPT-2 (medium) on a plain-text corpus, printing a few generated samples
during training so we can eyeball progress.

Multi-GPU (DDP) version:
    torchrun --nproc_per_node=4 09_gpt2_finetune_stories.py --train data/stories_train.txt \
        --valid data/stories_valid.txt --output runs/gpt2_stories
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup

SAMPLE_PROMPTS = [
    "Once upon a time",
    "The old lighthouse keeper",
    "In the year 2300,",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--output", default="runs/gpt2_ft")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def ddp_setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def ddp_cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class BlockDataset(Dataset):
    """Concatenate the whole file and cut it into fixed-size blocks."""

    def __init__(self, path, tokenizer, block_size):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        ids = tokenizer(text, return_attention_mask=False)["input_ids"]
        n_blocks = len(ids) // block_size
        self.data = torch.tensor(ids[: n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)

    def __len__(self):
        return self.data.size(0)

    def __getitem__(self, i):
        return self.data[i]


@torch.no_grad()
def generate_samples(model, tokenizer, device, max_new_tokens=80):
    model.eval()
    outputs = []
    for prompt in SAMPLE_PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, top_p=0.9,
                             temperature=0.8, pad_token_id=tokenizer.eos_token_id)
        outputs.append(tokenizer.decode(gen[0], skip_special_tokens=True))
    model.train()
    return outputs


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss_sum[0] += loss.float() * batch.size(0)
        loss_sum[1] += batch.size(0)
    dist.all_reduce(loss_sum)
    model.train()
    return (loss_sum[0] / loss_sum[1]).item()


def main():
    args = parse_args()
    local_rank = ddp_setup()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    tokenizer = GPT2TokenizerFast.from_pretrained(args.model)
    train_ds = BlockDataset(args.train, tokenizer, args.block_size)
    valid_ds = BlockDataset(args.valid, tokenizer, args.block_size)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, sampler=valid_sampler)

    model = GPT2LMHeadModel.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_loader) // args.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, updates_per_epoch * args.epochs)

    if is_main_process():
        os.makedirs(args.output, exist_ok=True)
        eff = args.batch_size * args.grad_accum * world_size
        print(f"{len(train_ds)} train blocks, effective batch {eff}, {updates_per_epoch} updates/epoch")

    step = 0
    best_val = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(enumerate(train_loader), total=len(train_loader),
                    disable=not is_main_process(), desc=f"epoch {epoch}")
        for i, batch in pbar:
            batch = batch.to(device, non_blocking=True)
            last_micro = (i + 1) % args.grad_accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if last_micro:
                    loss = model(input_ids=batch, labels=batch).loss / args.grad_accum
                    loss.backward()
                else:
                    with model.no_sync():
                        loss = model(input_ids=batch, labels=batch).loss / args.grad_accum
                        loss.backward()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if is_main_process():
                pbar.set_postfix(loss=f"{loss.item() * args.grad_accum:.3f}")

            if step % args.sample_every == 0 and is_main_process():
                for text in generate_samples(model, tokenizer, device):
                    print("-" * 40 + "\n" + text, flush=True)

            if step % args.eval_every == 0:
                val_loss = evaluate(model, valid_loader, device)
                if is_main_process():
                    print(f"step {step}: val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    if val_loss < best_val:
                        best_val = val_loss
                        model.module.save_pretrained(os.path.join(args.output, "best"))
                        tokenizer.save_pretrained(os.path.join(args.output, "best"))
                dist.barrier()

    if is_main_process():
        model.module.save_pretrained(os.path.join(args.output, "final"))
        tokenizer.save_pretrained(os.path.join(args.output, "final"))
    ddp_cleanup()


if __name__ == "__main__":
    main()
