"""
T5 summarization fine-tuning over a large set of JSONL shards ({"document": ..., "summary": ...}).

A byte-offset index (one .npy per shard, stored next to the shard) lets every epoch use a
global permutation of all documents instead of a shuffle buffer, and makes resuming cheap:
the position in the stream follows from (seed, epoch, samples consumed), nothing is re-read.

    torchrun --nproc_per_node=8 16_jsonl_offset_index_t5.py --data /nfs/datasets/news_sum/train \
        --val /nfs/datasets/news_sum/val --out /nfs/runs/t5_base_sum
"""
import argparse
import glob
import json
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer, T5ForConditionalGeneration


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="t5-base")
    ap.add_argument("--src_len", type=int, default=1024)
    ap.add_argument("--tgt_len", type=int, default=128)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=60_000)
    ap.add_argument("--eval_every", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def shard_offsets(path):
    idx_path = path + ".idx.npy"
    if os.path.exists(idx_path):
        return np.load(idx_path)
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    arr = np.asarray(offsets, dtype=np.int64)
    np.save(idx_path, arr)
    return arr


def build_index(data_dir):
    shards = sorted(glob.glob(os.path.join(data_dir, "*.jsonl")))
    pairs = []
    for si, path in enumerate(shards):
        offs = shard_offsets(path)
        pairs.append(np.stack([np.full_like(offs, si), offs], axis=1))
    return shards, np.concatenate(pairs)


class IndexedJsonl(IterableDataset):
    def __init__(self, shards, index, tok, args, rank, world, shuffle, start_sample=0):
        self.shards, self.index, self.tok, self.args = shards, index, tok, args
        self.rank, self.world, self.shuffle = rank, world, shuffle
        self.start_sample = start_sample  # samples already consumed by this rank

    def _encode(self, rec):
        src = self.tok("summarize: " + rec["document"], max_length=self.args.src_len, truncation=True)
        tgt = self.tok(text_target=rec["summary"], max_length=self.args.tgt_len, truncation=True)
        return src["input_ids"], tgt["input_ids"]

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        per_rank = len(self.index) // self.world
        handles = {}
        epoch, pos = divmod(self.start_sample, per_rank)
        while True:
            order = (np.random.default_rng([self.args.seed, epoch]).permutation(len(self.index))
                     if self.shuffle else np.arange(len(self.index)))
            mine = order[self.rank * per_rank:(self.rank + 1) * per_rank]
            for j in range(pos + wid, per_rank, nw):
                si, off = self.index[mine[j]]
                fh = handles.get(si) or handles.setdefault(si, open(self.shards[si], "rb"))
                fh.seek(off)
                yield self._encode(json.loads(fh.readline()))
            if not self.shuffle:
                return
            epoch, pos = epoch + 1, 0


def collate(batch, pad_id):
    S = max(len(s) for s, _ in batch)
    T = max(len(t) for _, t in batch)
    src = torch.full((len(batch), S), pad_id)
    lab = torch.full((len(batch), T), -100)
    for i, (s, t) in enumerate(batch):
        src[i, :len(s)] = torch.tensor(s)
        lab[i, :len(t)] = torch.tensor(t)
    return src, (src != pad_id).long(), lab


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    shards, index = build_index(args.data)
    val_shards, val_index = build_index(args.val)

    model = T5ForConditionalGeneration.from_pretrained(args.model).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step = 0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location=device)
        model.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        step = ck["step"]
    model = DDP(model, device_ids=[local_rank])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 1000) * (1 - s / (args.steps + 1)))
    for _ in range(step):
        sched.step()

    pad = tok.pad_token_id
    train_ds = IndexedJsonl(shards, index, tok, args, rank, world, shuffle=True, start_sample=step * args.bs)
    loader = DataLoader(train_ds, batch_size=args.bs, num_workers=args.workers, pin_memory=True,
                        collate_fn=partial(collate, pad_id=pad))
    val_ds = IndexedJsonl(val_shards, val_index, tok, args, rank, world, shuffle=False)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(index):,} training documents in {len(shards)} shards; resuming at step {step}")

    model.train()
    it = iter(loader)
    t0 = time.time()
    while step < args.steps:
        src, mask, lab = (x.to(device, non_blocking=True) for x in next(it))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=src, attention_mask=mask, labels=lab).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        step += 1

        if step % 100 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.2f}s/step", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                vl = DataLoader(val_ds, batch_size=32, num_workers=2, collate_fn=partial(collate, pad_id=pad))
                for vsrc, vmask, vlab in vl:
                    vsrc, vmask, vlab = vsrc.to(device), vmask.to(device), vlab.to(device)
                    out = model.module(input_ids=vsrc, attention_mask=vmask, labels=vlab)
                    n_tok = (vlab != -100).sum()
                    acc += torch.stack([out.loss.float() * n_tok, n_tok.float()])
            dist.all_reduce(acc)
            model.train()
            if rank == 0:
                print(f"step {step} val loss {(acc[0] / acc[1]).item():.4f}")
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step},
                           ck_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
