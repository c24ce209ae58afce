"""
IMDB sentiment fine-tune of distilbert-base-uncased, plain PyTorch loop,
two machines on the LAN (one GPU each).

node 0: 192.168.178.20 (RTX 3070)
node 1: 192.168.178.27 (RTX 2060 Super)

  torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 192.168.178.20 \
      --master-port 29502 imdb_ddp.py --epochs 2
  torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr 192.168.178.20 \
      --master-port 29502 imdb_ddp.py --epochs 2
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="distilbert-base-uncased")
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--fp16", action="store_true", default=True)
    parser.add_argument("--output", default="imdb-distilbert")
    parser.add_argument("--log-every", type=int, default=100)
    return parser.parse_args()


def prepare_data(tokenizer, max_len, local_rank):
    # the HF cache is per machine, so each node's local rank 0 downloads /
    # tokenizes first and the others on that node reuse the cached arrow files
    if local_rank != 0:
        dist.barrier()
    raw = load_dataset("imdb")

    def tok(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_len)

    enc = raw.map(tok, batched=True, remove_columns=["text"])
    enc = enc.rename_column("label", "labels")
    enc.set_format("torch")
    if local_rank == 0:
        dist.barrier()
    return enc["train"], enc["test"]


@torch.no_grad()
def evaluate(model, loader, device, fp16):
    model.eval()
    correct = 0
    total = 0
    loss_total = 0.0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            out = model(**batch)
        loss_total += out.loss.item() * batch["labels"].size(0)
        correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
        total += batch["labels"].size(0)
    stats = torch.tensor([loss_total, correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds, test_ds = prepare_data(tokenizer, args.max_len, local_rank)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size * 4, sampler=test_sampler,
                             collate_fn=collator, num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps),
                                                total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        print(f"world={world_size}, steps/epoch={len(train_loader)}, total={total_steps}")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % args.log_every == 0:
                el = time.time() - t0
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {el / args.log_every:.2f}s/step")
                t0 = time.time()

        test_loss, test_acc = evaluate(model, test_loader, device, args.fp16)
        if rank == 0:
            print(f"== epoch {epoch}: test loss {test_loss:.4f}, test acc {test_acc:.4f}")
            os.makedirs(args.output, exist_ok=True)
            model.module.save_pretrained(args.output)
            tokenizer.save_pretrained(args.output)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
