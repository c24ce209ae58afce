"""Fine-tune T5 for abstractive summarization (CNN/DailyMail).

Previously: apex.amp O1 with dynamic loss scaling (apex skipped steps with
overflowing gradients by itself) + apex DDP, launched via
torch.distributed.launch. Now: torch.amp + torch DDP + torchrun.
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_linear_schedule_with_warmup

logger = logging.getLogger("t5sum")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="t5-base")
    p.add_argument("--max-source", type=int, default=512)
    p.add_argument("--max-target", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--output-dir", default="out/t5-cnndm")
    p.add_argument("--eval-every", type=int, default=2000)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("cnn_dailymail", "3.0.0")

    def preprocess(batch):
        inputs = tokenizer(["summarize: " + a for a in batch["article"]], max_length=args.max_source,
                           truncation=True)
        labels = tokenizer(text_target=batch["highlights"], max_length=args.max_target, truncation=True)
        inputs["labels"] = labels["input_ids"]
        return inputs

    # tokenise once on rank 0; other ranks pick the result up from the datasets cache
    if rank == 0:
        tokenized = raw.map(preprocess, batched=True, num_proc=8, remove_columns=raw["train"].column_names)
    dist.barrier()
    if rank != 0:
        tokenized = raw.map(preprocess, batched=True, num_proc=8, remove_columns=raw["train"].column_names)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=42)
    val_sampler = DistributedSampler(tokenized["validation"], shuffle=False)
    train_loader = DataLoader(tokenized["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(tokenized["validation"], batch_size=32, sampler=val_sampler,
                            collate_fn=collator, num_workers=4, pin_memory=True)

    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(train_loader) // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, updates_per_epoch * args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = torch.zeros(2, device=device)
        for batch in val_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                out = model(**batch)
            ntok = (batch["labels"] != -100).sum()
            tot += torch.stack([out.loss.float() * ntok, ntok.float()])
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item()

    logger.info("world=%d effective batch=%d", world, args.batch_size * args.grad_accum * world)
    update = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        optimizer.zero_grad(set_to_none=True)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (step + 1) % args.grad_accum == 0
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss / args.grad_accum
            if not torch.isfinite(loss):
                logger.warning("non-finite loss at epoch %d step %d, skipping batch", epoch, step)
                continue
            if sync:
                scaler.scale(loss).backward()
            else:
                with model.no_sync():
                    scaler.scale(loss).backward()
            if not sync:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 100 == 0:
                logger.info("epoch %d update %d loss %.4f lr %.2e", epoch, update,
                            loss.item() * args.grad_accum, scheduler.get_last_lr()[0])
            if update % args.eval_every == 0:
                val_loss = evaluate()
                logger.info("update %d val loss %.4f ppl %.2f", update, val_loss, math.exp(val_loss))
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.output_dir, f"update-{update}"))
                    tokenizer.save_pretrained(os.path.join(args.output_dir, f"update-{update}"))

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
