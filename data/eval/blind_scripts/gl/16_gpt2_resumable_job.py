#!/usr/bin/env python3
"""Fault-tolerant GPT-2 medium fine-tuning on an instruction corpus.

    python 16_gpt2_resumable_job.py --nproc 8 --train /data/instr/train.jsonl --val /data/instr/val.jsonl \
        --out /shared/ft/gpt2m-instr

LocalJob keeps the worker group alive: if a rank dies, all ranks are stopped
and restarted, and the workers pick up from <out>/latest.pt.
"""
import argparse
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2LMHeadModel, GPT2TokenizerFast


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--as-worker", action="store_true")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--port", type=int, default=29800)
    ap.add_argument("--max-restarts", type=int, default=5)
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=500)
    return ap.parse_args()


@dataclasses.dataclass
class LocalJob:
    nproc: int
    port: int
    out: str
    argv: list
    procs: list = dataclasses.field(default_factory=list)

    def start(self, attempt):
        self.procs = []
        logdir = os.path.join(self.out, "logs")
        os.makedirs(logdir, exist_ok=True)
        for r in range(self.nproc):
            env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.nproc),
                   "MASTER_ADDR": "localhost", "MASTER_PORT": str(self.port), "JOB_ATTEMPT": str(attempt)}
            with open(os.path.join(logdir, f"rank{r}.attempt{attempt}.log"), "w") as fh:
                self.procs.append(subprocess.Popen([sys.executable, __file__, "--as-worker", *self.argv],
                                                   env=env, stdout=fh, stderr=subprocess.STDOUT))

    def stop(self, timeout=30):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        end = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def wait(self):
        while True:
            rcs = [p.poll() for p in self.procs]
            if any(rc not in (None, 0) for rc in rcs):
                return rcs
            if all(rc == 0 for rc in rcs):
                return rcs
            time.sleep(2)


def launch(args):
    job = LocalJob(args.nproc, args.port, args.out, sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda s, f: (job.stop(), sys.exit(143)))
    signal.signal(signal.SIGINT, lambda s, f: (job.stop(), sys.exit(130)))
    for attempt in range(args.max_restarts + 1):
        job.start(attempt)
        rcs = job.wait()
        if all(rc == 0 for rc in rcs):
            print("job finished", flush=True)
            return 0
        print(f"attempt {attempt} failed with {rcs}; restarting", file=sys.stderr, flush=True)
        job.stop()
        time.sleep(10)
    return 1


# --------------------------------------------------------------------------- training
class InstrDataset(Dataset):
    def __init__(self, path, tok, seq_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.seq_len = tok, seq_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = f"### Instruction:\n{r['instruction']}\n\n### Response:\n"
        p_ids = self.tok(prompt)["input_ids"]
        a_ids = self.tok(r["output"] + self.tok.eos_token)["input_ids"]
        ids = (p_ids + a_ids)[: self.seq_len]
        labels = ([-100] * len(p_ids) + a_ids)[: self.seq_len]
        pad = self.seq_len - len(ids)
        return (torch.tensor(ids + [self.tok.eos_token_id] * pad),
                torch.tensor([1] * len(ids) + [0] * pad),
                torch.tensor(labels + [-100] * pad))


@torch.no_grad()
def val_loss(model, dl, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for ids, mask, labels in dl:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        tgt = labels[:, 1:]
        s[0] += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                                  ignore_index=-100, reduction="sum")
        s[1] += (tgt != -100).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    tok = GPT2TokenizerFast.from_pretrained(args.model)
    train_ds = InstrDataset(args.train, tok, args.seq_len)
    val_ds = InstrDataset(args.val, tok, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)
    vdl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                     batch_size=args.batch_per_gpu * 2, num_workers=2)

    model = GPT2LMHeadModel.from_pretrained(args.model).to(device)
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(dl)
    warmup = int(0.03 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    latest = os.path.join(args.out, "latest.pt")
    step = 0
    if os.path.exists(latest):
        state = torch.load(latest)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
        del state
        if rank == 0:
            print(f"attempt {os.environ.get('JOB_ATTEMPT')}: resumed at step {step}", flush=True)

    start_epoch, skip = divmod(step, len(dl))
    model.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (ids, mask, labels) in enumerate(dl):
            if epoch == start_epoch and i < skip:
                continue
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 and rank == 0:
                print(f"step {step}/{total} loss {out.loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, latest + ".tmp")
                    os.replace(latest + ".tmp", latest)
                dist.barrier()
        vl = val_loss(model, vdl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if a.as_worker:
        worker(a)
    else:
        sys.exit(launch(a))
