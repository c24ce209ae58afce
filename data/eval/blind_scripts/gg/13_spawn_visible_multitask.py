#!/usr/bin/env python3
"""Multi-task text classifier (shared encoder, one head per task), one file.

    CUDA_VISIBLE_DEVICES=2,3,6,7 python 13_spawn_visible_multitask.py --out runs/mt --steps 30000

The launcher spawns one worker per visible GPU with torch.multiprocessing.
Each worker restricts itself to a single physical GPU via CUDA_VISIBLE_DEVICES
before it touches CUDA, so inside a worker that GPU is always cuda:0.
Tasks alternate step by step, so in any step the heads of the other tasks get
no gradient. Logs: <out>/logs/worker<k>.log. Failed groups are restarted and
resume from <out>/ckpt.pt.
"""
import argparse
import functools
import logging
import os
import socket
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from huggingface_hub import snapshot_download
from transformers import AutoModel, AutoTokenizer

TASKS = {"sentiment": ("data/sentiment_{}.csv", 3), "topic": ("data/topic_{}.csv", 20)}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--encoder", default="distilroberta-base")
    p.add_argument("--out", default="runs/mt")
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--batch", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--restarts", type=int, default=2)
    return p.parse_args()


class CsvTask(Dataset):
    def __init__(self, path, tok, max_len):
        df = pd.read_csv(path)
        self.enc = tok(df["text"].astype(str).tolist(), truncation=True, max_length=max_len)
        self.labels = df["label"].astype(int).tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.enc["input_ids"][i], "label": self.labels[i]}


def collate_padded(items, pad_id):
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    for j, x in enumerate(items):
        ids[j, :len(x["input_ids"])] = torch.tensor(x["input_ids"])
    return ids, (ids != pad_id).long(), torch.tensor([x["label"] for x in items])


class MultiTaskModel(nn.Module):
    def __init__(self, encoder_name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name)
        hidden = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.1), nn.Linear(hidden, n))
                                    for t, (_, n) in TASKS.items()})

    def forward(self, task, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = (h * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        return self.heads[task](pooled)


def cycle(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def worker(index, gpu_ids, port, args):
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu_ids[index]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    world, rank = len(gpu_ids), index
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    logging.basicConfig(filename=os.path.join(args.out, "logs", f"worker{rank}.log"), level=logging.INFO,
                        format=f"%(asctime)s rank{rank} gpu{gpu_ids[index]} %(message)s")
    log = logging.getLogger()

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    collate = functools.partial(collate_padded, pad_id=tok.pad_token_id)
    streams, val_loaders, samplers = {}, {}, {}
    for task, (pattern, _) in TASKS.items():
        train_ds = CsvTask(pattern.format("train"), tok, args.max_len)
        val_ds = CsvTask(pattern.format("val"), tok, args.max_len)
        samplers[task] = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
        loader = DataLoader(train_ds, batch_size=args.batch, sampler=samplers[task], collate_fn=collate,
                            num_workers=2, drop_last=True)
        streams[task] = cycle(loader, samplers[task])
        val_loaders[task] = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                                       collate_fn=collate)

    torch.manual_seed(7)
    model = MultiTaskModel(args.encoder).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world ** 0.5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / args.steps))
    step = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        log.info("resumed at step %d", step)
    # only one head takes part in each step, the others must be tolerated as unused
    ddp = DDP(model, device_ids=[0], find_unused_parameters=True)
    task_names = list(TASKS)

    t0 = time.time()
    while step < args.steps:
        task = task_names[step % len(task_names)]
        ids, mask, y = (t.to(device, non_blocking=True) for t in next(streams[task]))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(task, ids, mask), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        sched.step()
        step += 1
        if step % 100 == 0:
            log.info("step %d task %s loss %.4f (%.2fs/100)", step, task, loss.item(), time.time() - t0)
            t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            accs = {}
            with torch.no_grad():
                for t, vl in val_loaders.items():
                    c = torch.zeros(2, device=device)
                    for ids, mask, y in vl:
                        ids, mask, y = ids.to(device), mask.to(device), y.to(device)
                        c[0] += (model(t, ids, mask).argmax(-1) == y).sum()
                        c[1] += y.numel()
                    dist.all_reduce(c)
                    accs[t] = (c[0] / c[1]).item()
            model.train()
            log.info("step %d eval %s", step, accs)
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "sched": sched.state_dict(), "step": step}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = parse_args()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = [g.strip() for g in visible.split(",") if g.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    os.makedirs(args.out, exist_ok=True)
    snapshot_download(args.encoder)  # warm the hub cache once, workers then load offline copies
    for attempt in range(args.restarts + 1):
        port = free_port()
        print(f"attempt {attempt}: GPUs {gpu_ids}, rendezvous on port {port}", flush=True)
        try:
            mp.spawn(worker, args=(gpu_ids, port, args), nprocs=len(gpu_ids), join=True)
            return 0
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"attempt {attempt} failed: {e}", flush=True)
            time.sleep(15)
    return 1


if __name__ == "__main__":
    sys.exit(main())
