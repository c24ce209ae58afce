"""Instruction tuning with ZeRO-2 + optimizer CPU offload.

Run with torchrun (one process per GPU):
    torchrun --nproc_per_node 8 instruct_tune_offload.py --model mistralai/Mistral-7B-v0.1 \
        --data data/instruct.jsonl --out runs/mistral-it
"""
import argparse
import json
import math
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import wandb
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE = -100


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--val_fraction", type=float, default=0.02)
    p.add_argument("--out", default="runs/it")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--wandb_project", default="llm-it")
    # deepspeed launcher compatibility; torchrun passes LOCAL_RANK via env instead
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ChatJsonl(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = f"[INST] {r['prompt'].strip()} [/INST]"
        p_ids = self.tok(prompt)["input_ids"]
        a_ids = self.tok(" " + r["response"].strip(), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p_ids + a_ids)[: self.max_len]
        lab = ([IGNORE] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(lab)


def collate(pad_id):
    def fn(batch):
        L = max(x.size(0) for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), IGNORE, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : x.size(0)] = x
            lab[i, : y.size(0)] = y
            att[i, : x.size(0)] = 1
        return ids, lab, att
    return fn


def ds_config(args, world_size):
    return {
        "train_batch_size": args.micro_bs * args.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    stats = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for ids, lab, att in loader:
        ids, lab, att = ids.to(engine.device), lab.to(engine.device), att.to(engine.device)
        loss = engine(input_ids=ids, attention_mask=att, labels=lab).loss
        n = (lab[:, 1:] != IGNORE).sum()
        stats[0] += loss.double() * n
        stats[1] += n
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    engine.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token

    with open(args.data) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    # same seed on every rank -> identical split everywhere
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    n_val = max(1, int(len(rows) * args.val_fraction))
    val_rows, train_rows = rows[:n_val], rows[n_val:]

    train_ds = ChatJsonl(train_rows, tok, args.max_len)
    val_ds = ChatJsonl(val_rows, tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                              collate_fn=collate(tok.pad_token_id), num_workers=2, pin_memory=True)
    # strided shard without the sampler's padding repeats, so summed val loss counts each example once;
    # shards may differ by one example, fine here because a ZeRO-2 forward issues no collectives
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_shard, batch_size=args.micro_bs, shuffle=False,
                            collate_fn=collate(tok.pad_token_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    updates_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    warmup = int(total_updates * args.warmup_ratio)

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: get_cosine_schedule_with_warmup(opt, warmup, total_updates),
        config=ds_config(args, world),
    )

    start_epoch, skip_batches = 0, 0
    if os.path.exists(os.path.join(args.out, "latest")):
        path, client = engine.load_checkpoint(args.out)
        if path is not None:
            start_epoch = client["epoch"]
            skip_batches = client["batch_in_epoch"]

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.out.rstrip("/")),
                   resume="allow")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (ids, lab, att) in enumerate(train_loader):
            if epoch == start_epoch and i < skip_batches:
                continue
            ids, lab, att = ids.to(engine.device), lab.to(engine.device), att.to(engine.device)
            loss = engine(input_ids=ids, attention_mask=att, labels=lab).loss
            engine.backward(loss)
            engine.step()

            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if rank == 0 and step % 10 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0], "epoch": epoch}, step=step)
            if step % args.eval_every == 0:
                val_loss = evaluate(engine, val_loader)
                if rank == 0:
                    wandb.log({"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 20))}, step=step)
                engine.save_checkpoint(args.out, tag=f"global_step{step}",
                                       client_state={"epoch": epoch, "batch_in_epoch": i + 1})

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch + 1, "batch_in_epoch": 0})

    val_loss = evaluate(engine, val_loader)
    if rank == 0:
        wandb.log({"val/loss": val_loss})
        wandb.finish()
        engine.module.save_pretrained(os.path.join(args.out, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
