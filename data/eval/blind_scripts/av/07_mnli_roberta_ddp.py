"""RoBERTa-large on MNLI, DDP + fp16. Reports matched / mismatched accuracy after every epoch.

    torchrun --nproc_per_node=8 07_mnli_roberta_ddp.py --out runs/mnli_rl
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)

log = logging.getLogger("mnli")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--bsz", type=int, default=16, help="per-GPU batch size")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log_every", type=int, default=200)
    return ap.parse_args()


def init_dist():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def accuracy(model, dataset, collator, device, rank, world, bsz=128):
    """Each rank scores a strided slice; counts are summed so every example counts once."""
    model.eval()
    shard = Subset(dataset, range(rank, len(dataset), world))
    loader = DataLoader(shard, batch_size=bsz, collate_fn=collator, num_workers=2)
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**batch).logits
        counts[0] += (logits.argmax(-1) == labels).sum()
        counts[1] += labels.numel()
    dist.all_reduce(counts)
    model.train()
    return counts[0].item() / max(counts[1].item(), 1)


def main():
    args = cli()
    rank, world, local_rank = init_dist()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(ex):
        return tok(ex["premise"], ex["hypothesis"], truncation=True, max_length=args.max_len)

    if rank == 0:
        ds = load_dataset("glue", "mnli")
        ds = ds.map(encode, batched=True, desc="tokenize")
    dist.barrier()
    if rank != 0:
        ds = load_dataset("glue", "mnli")
        ds = ds.map(encode, batched=True)  # hits the cache written by rank 0
    ds = ds.remove_columns(["premise", "hypothesis", "idx"]).rename_column("label", "labels")
    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)

    train_loader = DataLoader(
        ds["train"], batch_size=args.bsz, shuffle=True, collate_fn=collator,
        num_workers=4, pin_memory=True, drop_last=True,
    )

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or "LayerNorm" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = len(train_loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    log.info("world=%d per-gpu bsz=%d steps=%d", world, args.bsz, total_steps)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            run[0] += loss.detach()
            run[1] += 1
            if step % args.log_every == 0:
                dist.all_reduce(run)
                log.info("ep %d step %d/%d loss %.4f lr %.3e %.1f it/s", epoch, step, total_steps,
                         (run[0] / run[1]).item(), sched.get_last_lr()[0], args.log_every / (time.time() - t0))
                run.zero_()
                t0 = time.time()

        acc_m = accuracy(model.module, ds["validation_matched"], collator, device, rank, world)
        acc_mm = accuracy(model.module, ds["validation_mismatched"], collator, device, rank, world)
        log.info("epoch %d  acc-m %.4f  acc-mm %.4f", epoch, acc_m, acc_mm)
        if rank == 0 and acc_m > best:
            best = acc_m
            model.module.save_pretrained(os.path.join(args.out, "best"))
            tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    log.info("best matched acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
