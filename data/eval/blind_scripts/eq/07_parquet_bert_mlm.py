#!/usr/bin/env python
"""
BERT-base masked-LM pretraining from pre-tokenized parquet shards.

Each parquet file holds a column `input_ids` (list<int32>, already cut to <= 512 tokens,
with [CLS]/[SEP]). Row groups are the unit of work: they are dealt out round-robin over
all (rank, worker) pairs so that every GPU reads a disjoint part of the corpus.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_parquet_bert_mlm.py --data "/lustre/corpora/bert_tok/*.parquet" --run_dir /lustre/runs/bert_base
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling
from transformers.optimization import get_polynomial_decay_schedule_with_warmup

log = logging.getLogger("mlm")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--tokenizer", default="bert-base-uncased")
    ap.add_argument("--micro_bs", type=int, default=64)
    ap.add_argument("--global_bs", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=250_000)
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=12345)
    return ap.parse_args()


class RowGroupStream(IterableDataset):
    def __init__(self, files, rank, world_size, seed):
        self.units = []
        for f in sorted(files):
            n = pq.ParquetFile(f).metadata.num_row_groups
            self.units.extend((f, g) for g in range(n))
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        slot, n_slots = self.rank * nw + wid, self.world_size * nw
        rng = np.random.default_rng([self.seed, slot])
        epoch = 0
        while True:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.units))
            mine = [self.units[i] for i in perm[slot::n_slots]]
            for path, g in mine:
                col = pq.ParquetFile(path).read_row_group(g, columns=["input_ids"]).column(0)
                rows = col.to_pylist()
                for j in rng.permutation(len(rows)):
                    yield {"input_ids": rows[j]}
            epoch += 1


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(args.seed)

    accum = args.global_bs // (args.micro_bs * world)
    assert accum * args.micro_bs * world == args.global_bs

    tokenizer = BertTokenizerFast.from_pretrained(args.tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, pad_to_multiple_of=8)
    ds = RowGroupStream(glob.glob(args.data), rank, world, args.seed)
    if len(ds.units) < world * args.workers:
        raise ValueError(f"only {len(ds.units)} row groups for {world * args.workers} readers")
    loader = DataLoader(ds, batch_size=args.micro_bs, collate_fn=collator,
                        num_workers=args.workers, pin_memory=True, persistent_workers=True)

    config = BertConfig.from_pretrained("bert-base-uncased")
    model = BertForMaskedLM(config).to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup, args.steps, power=1.0)

    start = 0
    latest = os.path.join(args.run_dir, "latest.pt")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start = ck["step"]
        log.info("resumed at step %d", start)
    model = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    data = iter(loader)
    model.train()
    tic = time.time()
    for step in range(start, args.steps):
        for k in range(accum):
            batch = {k2: v.to(device, non_blocking=True) for k2, v in next(data).items()}
            if k < accum - 1:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = model(**batch).loss / accum
                    scaler.scale(loss).backward()
            else:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(**batch).loss / accum
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if (step + 1) % args.log_every == 0 and rank == 0:
            avg = reduce_mean(loss.detach() * accum)
            secs = (time.time() - tic) / args.log_every
            log.info("step %d loss %.4f gnorm %.3f lr %.3e %.2fs/step",
                     step + 1, avg.item(), gnorm.item(), scheduler.get_last_lr()[0], secs)
            tic = time.time()

        if (step + 1) % args.ckpt_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step + 1}, latest + ".tmp")
                os.replace(latest + ".tmp", latest)
                log.info("saved %s", latest)
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.run_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
