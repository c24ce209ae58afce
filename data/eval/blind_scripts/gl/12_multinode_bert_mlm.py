#!/usr/bin/env python3
"""BERT-base MLM pretraining on pre-tokenised shards, with a small multi-node launcher.

Run once per node:
    python 12_multinode_bert_mlm.py --nnodes 4 --node-rank $NODE_RANK --nproc-per-node 8 \
        --master-addr gpu-a001 --master-port 29500 \
        --dataset /lustre/corpora/wiki_books_tok512 --output /lustre/runs/bert-base-mlm

The launcher process on each node starts its local workers, mirrors their
output into per-rank log files, forwards SIGTERM/SIGINT and exits with the
first non-zero worker exit code.
"""
import argparse
import datetime
import math
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling,
                          get_linear_schedule_with_warmup)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--nproc-per-node", type=int, default=8)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--tokenizer", default="bert-base-uncased")
    ap.add_argument("--output", required=True)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--max-steps", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=10_000)
    ap.add_argument("--save-every", type=int, default=5000)
    return ap.parse_args()


# ------------------------------------------------------------------------ launcher
def worker_env(args, local_rank):
    global_rank = args.node_rank * args.nproc_per_node + local_rank
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "WORLD_SIZE": str(args.nproc_per_node),
        "RANK": str(global_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
        "GROUP_RANK": str(args.node_rank),
        "NCCL_ASYNC_ERROR_HANDLING": "1",
    })
    return env, global_rank


def run_launcher(args):
    log_dir = os.path.join(args.output, "logs")
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for lr_ in range(args.nproc_per_node):
        env, grank = worker_env(args, lr_)
        f = open(os.path.join(log_dir, f"rank{grank:03d}.log"), "ab")
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--worker", *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        f.close()
    print(f"node {args.node_rank}: started {len(procs)} workers", flush=True)

    def forward(signum, _):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    while True:
        rcs = [p.poll() for p in procs]
        bad = [rc for rc in rcs if rc not in (None, 0)]
        if bad:
            print(f"node {args.node_rank}: worker failed ({rcs}), stopping node", file=sys.stderr, flush=True)
            forward(signal.SIGTERM, None)
            deadline = time.time() + 60
            for p in procs:
                try:
                    p.wait(max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
            return bad[0]
        if all(rc == 0 for rc in rcs):
            return 0
        time.sleep(10)


# ------------------------------------------------------------------------ worker
def run_worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    accum = args.global_batch // (args.micro_batch * world)
    assert accum >= 1 and accum * args.micro_batch * world == args.global_batch, \
        f"global batch {args.global_batch} not reachable with micro {args.micro_batch} x world {world}"

    tok = BertTokenizerFast.from_pretrained(args.tokenizer)
    ds = load_from_disk(args.dataset).with_format("torch", columns=["input_ids", "attention_mask"])
    collate = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                    num_workers=6, pin_memory=True, drop_last=True)

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=tok.vocab_size, max_position_embeddings=512)).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, args.max_steps)

    ckpt = os.path.join(args.output, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step = st["step"]

    epoch = (step * accum) // len(dl)
    model.train()
    t0, micro = time.time(), 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            micro += 1
            sync = micro % accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / accum
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach() * accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if is_main:
                    print(f"step {step} mlm_loss {l.item():.4f} ppl {math.exp(min(l.item(), 20)):.1f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.save_every == 0 or step == args.max_steps:
                if is_main:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
                    model.module.save_pretrained(os.path.join(args.output, f"hf_step{step}"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    a = get_args()
    if a.worker:
        run_worker(a)
    else:
        sys.exit(run_launcher(a))
