#!/usr/bin/env python
"""
Reward model for RLHF, trained on Anthropic HH preference pairs.

Plain DDP (no Trainer) so the loop is easy to modify. Gradient checkpointing
is used to fit 2k-token pairs, in its non-reentrant form.

    torchrun --nproc_per_node=8 07_rlhf_reward_model_hf.py \
        --model Qwen/Qwen2-0.5B --output-dir /mnt/shared/rm/qwen2-0.5b-hh --wandb
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-0.5B")
    p.add_argument("--dataset", default="Anthropic/hh-rlhf")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=128, help="preference pairs per optimizer step, all GPUs")
    p.add_argument("--lr", type=float, default=9e-6)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--eval-steps", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume-from", default=None, help="directory written by a previous run")
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


def tokenize_fn(tokenizer, max_length):
    def fn(batch):
        c = tokenizer(batch["chosen"], truncation=True, max_length=max_length)
        r = tokenizer(batch["rejected"], truncation=True, max_length=max_length)
        return {"chosen_ids": c["input_ids"], "rejected_ids": r["input_ids"]}
    return fn


def make_collate(pad_id):
    def collate(examples):
        seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        return ids, mask
    return collate


def reward_loss(model, ids, mask):
    scores = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
    chosen, rejected = scores.chunk(2)
    return -F.logsigmoid(chosen - rejected).mean(), chosen, rejected


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for ids, mask in loader:
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, c, r = reward_loss(model, ids, mask)
        acc[0] += loss.item() * c.numel()
        acc[1] += (c > r).sum().item()
        acc[2] += c.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    # keep the optimizer batch (and with it the lr / warmup) independent of the number of GPUs
    assert args.global_batch % (args.per_device_batch * world_size) == 0
    args.grad_accum = args.global_batch // (args.per_device_batch * world_size)

    if rank == 0 and args.wandb:
        import wandb
        wandb.init(project="reward-model", config={**vars(args), "world_size": world_size})

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # rank 0 tokenizes and fills the datasets cache, the others then read it
    if rank != 0:
        dist.barrier()
    raw = load_dataset(args.dataset)
    tokenized = raw.map(tokenize_fn(tokenizer, args.max_length), batched=True, num_proc=8,
                        remove_columns=raw["train"].column_names)
    if rank == 0:
        dist.barrier()

    train_ds = tokenized["train"]
    eval_ds = tokenized["test"].shard(num_shards=world_size, index=rank, contiguous=True)
    collate = make_collate(tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch * 2, collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1,
                                                               torch_dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(train_loader) // args.grad_accum
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)

    start_epoch, update = 0, 0
    if args.resume_from:
        model.load_state_dict(torch.load(os.path.join(args.resume_from, "model.pt"), map_location="cpu"))
        state = torch.load(os.path.join(args.resume_from, "trainer_state.pt"), map_location="cpu")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, update = state["epoch"], state["update"]

    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    def save(tag, epoch):
        if rank == 0:
            out = os.path.join(args.output_dir, tag)
            os.makedirs(out, exist_ok=True)
            ddp_model.module.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            torch.save(ddp_model.module.state_dict(), os.path.join(out, "model.pt"))
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "epoch": epoch, "update": update}, os.path.join(out, "trainer_state.pt"))
        dist.barrier()

    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        skip = (update - epoch * updates_per_epoch) * args.grad_accum if epoch == start_epoch else 0
        for micro, (ids, mask) in enumerate(train_loader):
            if micro < skip:
                continue
            if micro >= updates_per_epoch * args.grad_accum:
                break
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            last_micro = (micro + 1) % args.grad_accum == 0
            if last_micro:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, c, r = reward_loss(ddp_model, ids, mask)
                (loss / args.grad_accum).backward()
            else:
                with ddp_model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss, c, r = reward_loss(ddp_model, ids, mask)
                    (loss / args.grad_accum).backward()
                continue

            grad_norm = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1

            if update % 10 == 0:
                log = torch.tensor([loss.item(), (c > r).float().mean().item()], device=device)
                dist.all_reduce(log)
                log /= world_size
                if rank == 0:
                    print(f"ep {epoch} upd {update}/{total_updates} loss {log[0]:.4f} acc {log[1]:.3f} "
                          f"gnorm {grad_norm:.2f} {time.time() - t0:.0f}s", flush=True)
                    if args.wandb:
                        wandb.log({"train/loss": log[0].item(), "train/acc": log[1].item(),
                                   "train/grad_norm": grad_norm.item(),
                                   "train/lr": scheduler.get_last_lr()[0]}, step=update)

            if update % args.eval_steps == 0:
                eval_loss, eval_acc = evaluate(ddp_model.module, eval_loader, device)
                if rank == 0:
                    print(f"eval @ {update}: loss {eval_loss:.4f} acc {eval_acc:.4f}", flush=True)
                    if args.wandb:
                        wandb.log({"eval/loss": eval_loss, "eval/acc": eval_acc}, step=update)
                save(f"checkpoint-{update}", epoch)

    eval_loss, eval_acc = evaluate(ddp_model.module, eval_loader, device)
    if rank == 0:
        print(f"final eval: loss {eval_loss:.4f} acc {eval_acc:.4f}")
    save("final", args.epochs)
    if rank == 0 and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
