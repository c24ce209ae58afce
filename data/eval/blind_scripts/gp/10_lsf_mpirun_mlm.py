#!/usr/bin/env python3
"""Masked-LM continued pretraining (RoBERTa) under LSF + Open MPI.

    #BSUB -J mlm
    #BSUB -n 8
    #BSUB -R "span[ptile=4]"
    #BSUB -gpu "num=4"
    #BSUB -W 24:00
    #BSUB -o logs/mlm.%J.log
    module load openmpi/4.1 cuda/12.2
    mpirun -np 8 --map-by ppr:4:node --bind-to none \
        python mlm_lsf.py --corpus /gpfs/nlp/corpus/domain.txt --work /gpfs/nlp/mlm_run

Open MPI only starts the processes; the rank layout comes from its
OMPI_COMM_WORLD_* variables and the rendezvous host from LSB_HOSTS.
"""
import argparse
import hashlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          get_polynomial_decay_schedule_with_warmup)


def env_from_lsf_ompi(port):
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    local_rank = int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    hosts = os.environ["LSB_HOSTS"].split()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=hosts[0], MASTER_PORT=str(port))
    return rank, world, local_rank


def tokenize_corpus(corpus, tokenizer, block):
    ids = []
    with open(corpus, encoding="utf-8") as f:
        buf = []
        for line in f:
            line = line.strip()
            if not line:
                continue
            buf.append(line)
            if len(buf) == 4096:
                for enc in tokenizer(buf, add_special_tokens=False)["input_ids"]:
                    ids.extend(enc + [tokenizer.sep_token_id])
                buf = []
        if buf:
            for enc in tokenizer(buf, add_special_tokens=False)["input_ids"]:
                ids.extend(enc + [tokenizer.sep_token_id])
    body = block - 2
    n = len(ids) // body
    arr = np.asarray(ids[: n * body], dtype=np.int32).reshape(n, body)
    cls = np.full((n, 1), tokenizer.cls_token_id, dtype=np.int32)
    eos = np.full((n, 1), tokenizer.eos_token_id, dtype=np.int32)
    return np.concatenate([cls, arr, eos], axis=1)


class Blocks(Dataset):
    def __init__(self, arr):
        self.arr = arr

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, i):
        return {"input_ids": torch.from_numpy(self.arr[i].astype(np.int64))}


def load_blocks(args, tokenizer):
    key = hashlib.md5(f"{args.corpus}|{args.model}|{args.block}".encode()).hexdigest()[:10]
    cache = os.path.join(args.work, f"blocks_{key}.npy")
    if os.path.exists(cache):
        arr = np.load(cache, mmap_mode="r")
    else:
        arr = tokenize_corpus(args.corpus, tokenizer, args.block)
        os.makedirs(args.work, exist_ok=True)
        np.save(cache, arr)
    n_val = max(1, int(len(arr) * args.val_frac))
    return Blocks(arr[n_val:]), Blocks(arr[:n_val])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum()
        s[0] += out.loss.double() * n
        s[1] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--val-frac", type=float, default=0.005)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--port", type=int, default=29701)
    args = ap.parse_args()

    rank, world, local_rank = env_from_lsf_ompi(args.port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, val_ds = load_blocks(args, tok)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    accum = args.global_batch // (args.micro_batch * world)
    assert accum >= 1
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_batch, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        collate_fn=collator, num_workers=2)

    model = AutoModelForMaskedLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = get_polynomial_decay_schedule_with_warmup(opt, args.warmup_steps, args.max_steps)

    if rank == 0:
        print(f"world={world} accum={accum} train_blocks={len(train_ds)}", flush=True)

    step, epoch, t0 = 0, 0, time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / accum
                loss.backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / accum
                    loss.backward()
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item() * accum:.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % 2000 == 0 or step == args.max_steps:
                vl = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                    model.module.save_pretrained(os.path.join(args.work, f"step_{step}"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
