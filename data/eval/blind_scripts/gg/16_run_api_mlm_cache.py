#!/usr/bin/env python3
"""Domain-adaptive MLM pre-training (RoBERTa) with an embedded elastic launcher.

Single node:
    python 16_run_api_mlm_cache.py --nnodes 1 --nproc-per-node 8 --corpus /shared/corpus/*.txt
Two nodes (same command on both; --rdzv-endpoint is the first node):
    python 16_run_api_mlm_cache.py --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node01:29400 \
        --run-id mlm-0415 --corpus '/shared/corpus/*.txt' --out /shared/runs/mlm

The launcher hands its options to torch.distributed.run (the code behind
torchrun) and re-executes this file with --worker. Tokenised blocks are cached
as one .npy under --out (shared storage): global rank 0 builds it, every other
rank waits at a barrier and then memory-maps the finished file.
"""
import argparse
import datetime
import glob
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          get_linear_schedule_with_warmup)


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nnodes", default="1")
    p.add_argument("--nproc-per-node", default="gpu")
    p.add_argument("--rdzv-endpoint", default="localhost:29400")
    p.add_argument("--run-id", default="mlm")
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--corpus", default="/shared/corpus/*.txt")
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--out", default="/shared/runs/mlm")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--save-every", type=int, default=1000)
    return p


def build_cache(files, tok, block, path):
    ids = []
    for fn in sorted(files):
        with open(fn, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    ids.extend(tok(line, add_special_tokens=False)["input_ids"] + [tok.sep_token_id])
    n = len(ids) // (block - 2)
    arr = np.asarray(ids[: n * (block - 2)], dtype=np.int32).reshape(n, block - 2)
    tmp = path + ".tmp.npy"
    np.save(tmp, arr)
    os.replace(tmp, path)


class Blocks(Dataset):
    def __init__(self, path, cls_id, sep_id):
        self.arr = np.load(path, mmap_mode="r")
        self.cls, self.sep = cls_id, sep_id

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, i):
        return {"input_ids": [self.cls] + self.arr[i].tolist() + [self.sep]}


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the first run spends a while in build_cache before the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    tok = AutoTokenizer.from_pretrained(args.model)
    cache = os.path.join(args.out, f"blocks_{args.block}.npy")
    if rank == 0 and not os.path.exists(cache):
        t0 = time.time()
        build_cache(glob.glob(args.corpus), tok, args.block, cache)
        print(f"built {cache} in {time.time() - t0:.0f}s", flush=True)
    dist.barrier(device_ids=[local_rank])
    data = Blocks(cache, tok.cls_token_id, tok.sep_token_id)

    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch, "global batch must divide evenly"
    sampler = DistributedSampler(data, shuffle=True, seed=11, drop_last=True)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = AutoModelForMaskedLM.from_pretrained(args.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * args.max_steps), args.max_steps)
    step, epoch = 0, 0
    state_path = os.path.join(args.out, "state.pt")
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]
    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        print(f"restart {restart}: world {world}, accum {accum}, resuming at step {step}", flush=True)

    micro = 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            micro += 1
            boundary = micro % accum == 0
            ctx = model.no_sync() if not boundary else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / accum
                loss.backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                stat = (loss.detach() * accum).float()
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} mlm loss {stat.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.save_every == 0 or step == args.max_steps:
                if rank == 0:
                    st = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "step": step, "epoch": epoch}
                    torch.save(st, state_path + ".tmp")
                    os.replace(state_path + ".tmp", state_path)
                    model.module.save_pretrained(os.path.join(args.out, "hf"))
                dist.barrier(device_ids=[local_rank])
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


def launch(args):
    from torch.distributed.run import get_args_parser, run

    os.makedirs(args.out, exist_ok=True)
    torchrun_args = get_args_parser().parse_args([
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.run_id}",
        f"--max-restarts={args.max_restarts}",
        f"--log-dir={os.path.join(args.out, 'logs', os.uname().nodename)}",
        "--redirects=3",
        "--tee=3",
        os.path.abspath(__file__),
        "--worker",
        *sys.argv[1:],
    ])
    run(torchrun_args)


if __name__ == "__main__":
    cli = parser().parse_args()
    if cli.worker:
        worker(cli)
    else:
        launch(cli)
