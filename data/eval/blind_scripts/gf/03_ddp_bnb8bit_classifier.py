"""
DDP fine-tuning of a large encoder (DeBERTa-v3-large) for sequence classification on
two 24GB cards, using bitsandbytes paged 8-bit AdamW, activation checkpointing and
gradient accumulation.

    torchrun --standalone --nproc_per_node=2 03_ddp_bnb8bit_classifier.py --config cfg/mnli.yaml
"""
import argparse
import contextlib
import os
import random
import time

import bitsandbytes as bnb
import numpy as np
import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

DEFAULTS = {
    "model_name": "microsoft/deberta-v3-large",
    "task": "mnli",
    "max_length": 256,
    "per_device_batch": 8,
    "grad_accum": 4,
    "epochs": 3,
    "lr": 1e-5,
    "warmup_ratio": 0.06,
    "weight_decay": 0.01,
    "seed": 17,
    "output_dir": "out/deberta-mnli",
    "resume": None,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=str, default=None)
    ap.add_argument("--resume", type=str, default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if ns.resume:
        cfg["resume"] = ns.resume
    return argparse.Namespace(**cfg)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_loaders(cfg, tokenizer, rank, world_size):
    raw = load_dataset("glue", cfg.task)

    def tok(batch):
        return tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=cfg.max_length)

    # tokenise once on rank 0 so the HF cache is populated, the others then hit the cache
    if rank == 0:
        enc = raw.map(tok, batched=True)
    dist.barrier()
    if rank != 0:
        enc = raw.map(tok, batched=True)
    enc = enc.remove_columns(["premise", "hypothesis", "idx"]).rename_column("label", "labels")
    enc.set_format("torch")

    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(enc["train"], num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=cfg.seed, drop_last=True)
    # strided shard without padding, so every validation example is counted exactly once
    val_set = Subset(enc["validation_matched"], list(range(rank, len(enc["validation_matched"]), world_size)))
    train_loader = DataLoader(enc["train"], batch_size=cfg.per_device_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.per_device_batch * 2, shuffle=False,
                            collate_fn=collate, num_workers=2)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct, seen, loss_sum
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        preds = out.logits.argmax(-1)
        n = batch["labels"].numel()
        stats[0] += (preds == batch["labels"]).sum()
        stats[1] += n
        stats[2] += out.loss.float() * n
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def save_checkpoint(path, model, optimizer, scheduler, epoch, step, rank):
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step": step,
        }, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    cfg = load_config()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    seed_everything(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, num_labels=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)

    train_loader, val_loader, train_sampler = build_loaders(cfg, tokenizer, rank, world_size)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = bnb.optim.PagedAdamW8bit(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)
    updates_per_epoch = len(train_loader) // cfg.grad_accum
    total_updates = updates_per_epoch * cfg.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_updates), total_updates)

    start_epoch, global_step = 0, 0
    if cfg.resume and os.path.isfile(cfg.resume):
        ckpt = torch.load(cfg.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step = ckpt["epoch"] + 1, ckpt["step"]
        del ckpt

    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank,
                    find_unused_parameters=False, gradient_as_bucket_view=True)

    best_acc = 0.0
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % cfg.grad_accum == 0
            ctx = contextlib.nullcontext() if sync_now else ddp_model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp_model(**batch).loss / cfg.grad_accum
                loss.backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if rank == 0 and global_step % 50 == 0:
                print(f"ep {epoch} step {global_step}/{total_updates} loss {loss.item() * cfg.grad_accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s", flush=True)
                t0 = time.time()

        acc, vloss = evaluate(ddp_model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val_acc {acc:.4f} val_loss {vloss:.4f}", flush=True)
        save_checkpoint(os.path.join(cfg.output_dir, "last.pt"), ddp_model, optimizer, scheduler,
                        epoch, global_step, rank)
        if acc > best_acc:
            best_acc = acc
            if rank == 0:
                ddp_model.module.save_pretrained(os.path.join(cfg.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(cfg.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
