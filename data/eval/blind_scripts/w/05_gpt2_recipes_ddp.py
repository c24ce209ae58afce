"""
Fine-tune GPT-2 (small/medium) on a recipes text corpus with plain PyTorch DDP.
Prints a few generated samples after every epoch so I can eyeball progress.

    torchrun --nproc_per_node=4 05_gpt2_recipes_ddp.py --model gpt2-medium --epochs 3
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPTS = [
    "Title: Lemon garlic chicken\nIngredients:",
    "Title: Vegan chocolate brownies\nIngredients:",
    "Title: Spicy lentil soup\nIngredients:",
]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--data_file", default="data/recipes.txt")
    parser.add_argument("--block_size", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=200)
    parser.add_argument("--output_dir", default="gpt2-recipes")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def group_texts(examples, block_size):
    concatenated = {k: sum(examples[k], []) for k in examples.keys()}
    total_length = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {
        k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


def build_datasets(tokenizer, args, rank):
    raw = load_dataset("text", data_files={"train": args.data_file})
    raw = raw["train"].train_test_split(test_size=0.02, seed=args.seed)

    def tok(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    # rank 0 builds the HF datasets cache first, the others then load it from disk
    if rank != 0:
        dist.barrier()
    tokenized = raw.map(tok, batched=True, remove_columns=["text"], num_proc=4)
    lm = tokenized.map(lambda ex: group_texts(ex, args.block_size), batched=True, num_proc=4)
    if rank == 0:
        dist.barrier()
    lm.set_format("torch")
    return lm["train"], lm["test"]


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        totals[0] += out.loss * batch["input_ids"].size(0)
        totals[1] += batch["input_ids"].size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def generate_samples(model, tokenizer, device, max_new_tokens=120):
    model.eval()
    samples = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, top_p=0.92,
                             temperature=0.8, pad_token_id=tokenizer.eos_token_id)
        samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return samples


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token
    train_ds, val_ds = build_datasets(tokenizer, args, rank)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    # every rank gets a disjoint strided slice of the validation blocks
    val_shard = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False)

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"train blocks: {len(train_ds)}, val blocks: {len(val_ds)}, steps: {total_steps}")

    best_val = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        pbar = tqdm(train_loader, disable=(rank != 0), desc=f"epoch {epoch}")
        for step, batch in enumerate(pbar):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                pbar.set_postfix(loss=f"{loss.item():.3f}")

        val = eval_loss(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val_loss={val:.4f} ppl={math.exp(val):.1f} ({time.time() - t0:.0f}s)")
            for s in generate_samples(model, tokenizer, device):
                print("-" * 60)
                print(s)
            if val < best_val:
                best_val = val
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        print(f"done. best val loss {best_val:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
