#!/usr/bin/env python
"""BERT-base masked-LM pretraining from pre-packed 512-token sequences.

Input is produced by pack_sequences.py:
    <data>/train_ids.npy   int32 [N, 512], already [CLS] ... [SEP] packed
    <data>/valid_ids.npy   int32 [M, 512]

Launch:
    torchrun --nproc_per_node=8 02_bert_mlm_memmap.py --data /datasets/wiki_books_512
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM, get_linear_schedule_with_warmup

logger = logging.getLogger("bert-mlm")

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103


class PackedSequences(Dataset):
    def __init__(self, path):
        self.path = path
        self.arr = None
        self.n = np.load(path, mmap_mode="r").shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        if self.arr is None:  # open lazily so each worker gets its own mmap handle
            self.arr = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.asarray(self.arr[idx], dtype=np.int64))


class MLMCollator:
    def __init__(self, vocab_size, mlm_prob=0.15):
        self.vocab_size = vocab_size
        self.mlm_prob = mlm_prob

    def __call__(self, batch):
        input_ids = torch.stack(batch)
        labels = input_ids.clone()
        special = (input_ids == PAD_ID) | (input_ids == CLS_ID) | (input_ids == SEP_ID)
        prob = torch.full(labels.shape, self.mlm_prob)
        prob.masked_fill_(special, 0.0)
        masked = torch.bernoulli(prob).bool()
        labels[~masked] = -100
        replace = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
        input_ids[replace] = MASK_ID
        rand = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replace
        input_ids[rand] = torch.randint(self.vocab_size, labels.shape)[rand]
        attention_mask = (input_ids != PAD_ID).long()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output_dir", default="checkpoints/bert-base-mlm")
    ap.add_argument("--config", default="configs/bert-base.json")
    ap.add_argument("--per_device_batch", type=int, default=32)
    ap.add_argument("--accum_steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup_steps", type=int, default=10000)
    ap.add_argument("--total_steps", type=int, default=1000000)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--num_workers", type=int, default=6)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum()
        stats[0] += out.loss.float() * n
        stats[1] += n
    dist.all_reduce(stats)
    model.train()
    mean = (stats[0] / stats[1]).item()
    return mean, math.exp(mean)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    with open(args.config) as f:
        config = BertConfig(**json.load(f))
    model = BertForMaskedLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])

    collate = MLMCollator(config.vocab_size)
    train_ds = PackedSequences(os.path.join(args.data, "train_ids.npy"))
    valid_ds = PackedSequences(os.path.join(args.data, "valid_ids.npy"))
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True,
                              collate_fn=collate, drop_last=True, persistent_workers=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    valid_loader = DataLoader(valid_ds, batch_size=args.per_device_batch, sampler=valid_sampler,
                              num_workers=2, pin_memory=True, collate_fn=collate)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.total_steps)
    scaler = torch.cuda.amp.GradScaler()

    global_batch = args.per_device_batch * args.accum_steps * world
    logger.info("world=%d global batch=%d sequences (%d tokens)", world, global_batch, global_batch * 512)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    step, micro, epoch = 0, 0, 0
    running, t0 = 0.0, time.time()
    model.train()
    while step < args.total_steps:
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            micro += 1
            sync_now = micro % args.accum_steps == 0
            with torch.autocast("cuda", dtype=torch.float16):
                if sync_now:
                    loss = model(**batch).loss / args.accum_steps
                    scaler.scale(loss).backward()
                else:
                    with model.no_sync():
                        loss = model(**batch).loss / args.accum_steps
                        scaler.scale(loss).backward()
            running += loss.item()
            if not sync_now:
                continue

            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                elapsed = time.time() - t0
                logger.info("epoch %d step %d loss %.4f lr %.2e %.1f seq/s", epoch, step, running / 100,
                            scheduler.get_last_lr()[0], 100 * global_batch / elapsed)
                running, t0 = 0.0, time.time()

            if step % args.eval_every == 0:
                val_loss, val_ppl = evaluate(model, valid_loader, device)
                logger.info("step %d valid loss %.4f ppl %.2f", step, val_loss, val_ppl)

            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict(),
                            "step": step}, os.path.join(args.output_dir, f"step_{step}.pt"))
                model.module.save_pretrained(os.path.join(args.output_dir, "latest"))
            if step >= args.total_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
