"""
Fine-tune SmolLM2-360M on customer-support dialogs (JSONL with a "text" field per conversation).
DDP + gradient accumulation + gradient checkpointing so it fits on 24 GB cards.

    torchrun --nproc_per_node=4 18_smollm_dialog_ddp.py --train data/support_train.jsonl \
        --valid data/support_valid.jsonl --grad_accum 8
"""
import argparse
import contextlib
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset, load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, get_scheduler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-360M")
    ap.add_argument("--train", default="data/support_train.jsonl")
    ap.add_argument("--valid", default="data/support_valid.jsonl")
    ap.add_argument("--cache", default="cache/support_tok")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=200, help="in optimizer steps")
    ap.add_argument("--out", default="smollm-support")
    ap.add_argument("--wandb_project", default="smollm-support")
    return ap.parse_args()


def tokenize_to_disk(args, tokenizer):
    raw = load_dataset("json", data_files={"train": args.train, "valid": args.valid})

    def tok(batch):
        texts = [t + tokenizer.eos_token for t in batch["text"]]
        return tokenizer(texts, truncation=True, max_length=args.max_len)

    tokenized = raw.map(tok, batched=True, remove_columns=raw["train"].column_names, num_proc=8)
    tokenized.save_to_disk(args.cache)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        totals += torch.stack([loss.float() * batch["input_ids"].size(0),
                               torch.tensor(float(batch["input_ids"].size(0)), device=device)])
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: on the first run rank 0 tokenizes while the others sit in the barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # rank 0 tokenizes and writes the cache, the others wait and then only read it
    if is_main and not os.path.isdir(args.cache):
        tokenize_to_disk(args, tokenizer)
    dist.barrier()
    data = load_from_disk(args.cache)

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=8)
    sampler = DistributedSampler(data["train"], shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(data["train"], batch_size=args.micro_bs, sampler=sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    valid_part = Subset(data["valid"], range(rank, len(data["valid"]), world))
    valid_loader = DataLoader(valid_part, batch_size=args.micro_bs * 2, collate_fn=collator)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    # non-reentrant checkpointing plays well with DDP's autograd hooks
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=int(0.05 * total_steps),
                              num_training_steps=total_steps)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world,
                                                       "global_batch": args.micro_bs * args.grad_accum * world})
        print(f"{len(data['train'])} train convs, {total_steps} optimizer steps")

    step, best_val = 0, float("inf")
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        pbar = tqdm(total=steps_per_epoch, disable=not is_main, desc=f"epoch {epoch}")
        accum_loss = torch.zeros((), device=device)
        for i, batch in enumerate(train_loader):
            if i >= steps_per_epoch * args.grad_accum:
                break  # same count on every rank: the sampler gives them equal lengths
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % args.grad_accum == 0
            # skip the gradient all-reduce on the accumulation micro-steps
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            accum_loss += loss.detach()
            if not last_micro:
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            pbar.update(1)

            dist.all_reduce(accum_loss, op=dist.ReduceOp.AVG)
            if is_main:
                pbar.set_postfix(loss=f"{accum_loss.item():.3f}")
                wandb.log({"train/loss": accum_loss.item(), "train/grad_norm": grad_norm.item(),
                           "lr": scheduler.get_last_lr()[0]}, step=step)
            accum_loss.zero_()

            if step % args.eval_every == 0:
                val_loss = evaluate(model.module, valid_loader, device)
                if is_main:
                    wandb.log({"valid/loss": val_loss, "valid/ppl": math.exp(val_loss)}, step=step)
                    print(f"\nstep {step}: valid loss {val_loss:.4f}")
                    if val_loss < best_val:
                        best_val = val_loss
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tokenizer.save_pretrained(os.path.join(args.out, "best"))
        pbar.close()
        if is_main:
            print(f"epoch {epoch} done in {(time.time() - t0) / 60:.1f} min")

    val_loss = evaluate(model.module, valid_loader, device)
    if is_main:
        print(f"final valid loss {val_loss:.4f} (best {min(best_val, val_loss):.4f})")
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tokenizer.save_pretrained(os.path.join(args.out, "final"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
