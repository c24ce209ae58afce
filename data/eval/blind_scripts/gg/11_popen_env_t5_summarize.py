#!/usr/bin/env python3
"""T5 summarisation fine-tuning with a homegrown multi-process launcher.

    python 11_popen_env_t5_summarize.py --nproc 4 --train data/train.jsonl --valid data/valid.jsonl

`launch` (default) starts --nproc copies of this file in `--mode train`, each
with its own env:// variables and log file (<out>/logs/rank_<k>.out), and
re-launches the group when a rank crashes. Training resumes from <out>/last/.
"""
import argparse
import functools
import json
import os
import random
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["launch", "train"], default="launch")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--max-relaunch", type=int, default=3)
    p.add_argument("--model", default="t5-base")
    p.add_argument("--train", default="data/train.jsonl")
    p.add_argument("--valid", default="data/valid.jsonl")
    p.add_argument("--out", default="runs/t5_sum")
    p.add_argument("--src-len", type=int, default=768)
    p.add_argument("--tgt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per process")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW lr for the default 4 GPUs")
    p.add_argument("--epochs", type=int, default=4)
    return p.parse_args()


class JsonlPairs(Dataset):
    def __init__(self, path, tok, src_len, tgt_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        src = self.tok("summarize: " + r["document"], max_length=self.src_len, truncation=True)
        tgt = self.tok(text_target=r["summary"], max_length=self.tgt_len, truncation=True)
        return {"input_ids": src["input_ids"], "labels": tgt["input_ids"]}


def _pad(seqs, value):
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (n - len(s)) for s in seqs])


def collate_pairs(batch, pad_id):
    ids = _pad([b["input_ids"] for b in batch], pad_id)
    return {"input_ids": ids, "attention_mask": (ids != pad_id).long(),
            "labels": _pad([b["labels"] for b in batch], -100)}


def train(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    resume_dir = os.path.join(args.out, "last")
    src = resume_dir if os.path.isdir(resume_dir) else args.model
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForSeq2SeqLM.from_pretrained(src).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    train_ds = JsonlPairs(args.train, tok, args.src_len, args.tgt_len)
    valid_ds = JsonlPairs(args.valid, tok, args.src_len, args.tgt_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    collate = functools.partial(collate_pairs, pad_id=tok.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=16,
                          collate_fn=collate, num_workers=2)

    lr = args.lr * (args.batch * args.accum * world) / (args.batch * args.accum * 4)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    updates_per_epoch = len(train_dl) // args.accum
    sched = get_linear_schedule_with_warmup(optim, 500, updates_per_epoch * args.epochs)
    state_file = os.path.join(resume_dir, "trainer_state.pt")
    first_epoch = 0
    if os.path.exists(state_file):
        st = torch.load(state_file, map_location="cpu")
        optim.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        first_epoch = st["epoch"] + 1

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (step + 1) % args.accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if last_micro:
                    loss = model(**batch).loss / args.accum
                    loss.backward()
                else:
                    with model.no_sync():
                        loss = model(**batch).loss / args.accum
                        loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item() * args.accum:.4f}", flush=True)

        model.eval()
        sums = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in valid_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                n_tok = (batch["labels"] != -100).sum()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    sums[0] += model.module(**batch).loss.float() * n_tok
                sums[1] += n_tok
        dist.all_reduce(sums)
        if rank == 0:
            print(f"epoch {epoch} valid token loss {(sums[0] / sums[1]).item():.4f}", flush=True)
            tmp = resume_dir + ".tmp"
            model.module.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            torch.save({"optim": optim.state_dict(), "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(tmp, "trainer_state.pt"))
            if os.path.isdir(resume_dir):
                os.rename(resume_dir, resume_dir + ".old")
            os.rename(tmp, resume_dir)
            subprocess.run(["rm", "-rf", resume_dir + ".old"])
        dist.barrier()

    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher
def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_env(rank, nproc):
    env = os.environ.copy()
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(find_free_port())
    env["WORLD_SIZE"] = str(nproc)
    env["RANK"] = str(rank)
    env["LOCAL_RANK"] = str(rank)
    env["LOCAL_WORLD_SIZE"] = str(nproc)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def launch(args):
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    argv = [a for a in sys.argv[1:]]
    for round_ in range(args.max_relaunch + 1):
        procs = []
        for rank in range(args.nproc):
            out = open(os.path.join(log_dir, f"rank_{rank}.out"), "ab")
            procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--mode", "train"],
                                          env=worker_env(rank, args.nproc), stdout=out, stderr=subprocess.STDOUT))
            out.close()
        while all(p.poll() is None for p in procs):
            time.sleep(5)
        # first exit seen; if it was a crash take the rest down too
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            print(f"[launch] round {round_} crashed: {[p.returncode for p in procs]}", flush=True)
            continue
        rcs = [p.wait() for p in procs]
        if all(rc == 0 for rc in rcs):
            return 0
        print(f"[launch] round {round_} ended with {rcs}", flush=True)
    return 1


if __name__ == "__main__":
    a = cli()
    if a.mode == "train":
        train(a)
    else:
        sys.exit(launch(a))
