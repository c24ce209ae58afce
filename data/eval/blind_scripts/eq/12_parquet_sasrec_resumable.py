#!/usr/bin/env python
# Next-item prediction (SASRec-style transformer) on user interaction sequences.
#
# Data: parquet shards under --data, columns: user_id (int64), items (list<int32>, oldest first).
# The iterator is deterministic given (seed, rank, worker), so resuming only needs the
# step count: each rank fast-forwards its stream by the number of batches it consumed.
#
#   torchrun --nproc_per_node=8 12_parquet_sasrec_resumable.py --data /data/seq_parquet \
#       --ckpt_dir /nfs/ckpt/sasrec --resume
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--num_items", type=int, default=200_000)
    ap.add_argument("--max_len", type=int, default=200)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max_steps", type=int, default=100_000)
    ap.add_argument("--save_every", type=int, default=2_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class SequenceStream(IterableDataset):
    def __init__(self, files, rank, world_size, batch_size, max_len, seed, skip_batches=0):
        self.files = sorted(files)
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.max_len, self.seed = batch_size, max_len, seed
        self.skip_batches = skip_batches

    def _batches(self, files, rng):
        epoch = 0
        while True:
            for fi in rng.permutation(len(files)):
                table = pq.read_table(files[fi], columns=["items"])
                seqs = table.column("items").to_pylist()
                order = rng.permutation(len(seqs))
                for s in range(0, len(order) - self.batch_size + 1, self.batch_size):
                    x = np.zeros((self.batch_size, self.max_len + 1), dtype=np.int64)
                    for r, j in enumerate(order[s:s + self.batch_size]):
                        seq = seqs[j][-(self.max_len + 1):]
                        x[r, -len(seq):] = seq  # left-padded with 0
                    yield torch.from_numpy(x)
            epoch += 1

    def __iter__(self):
        info = get_worker_info()
        nw, wid = (info.num_workers, info.id) if info else (1, 0)
        slot = self.rank * nw + wid
        files = self.files[slot::self.world_size * nw]
        rng = np.random.default_rng([self.seed, slot])
        # DataLoader takes batches from workers round-robin, so worker `wid` produced
        # ceil((skip - wid) / nw) of the batches this rank already trained on
        to_skip = max(0, (self.skip_batches - wid + nw - 1) // nw)
        for k, batch in enumerate(self._batches(files, rng)):
            if k < to_skip:
                continue
            yield batch


class SASRec(nn.Module):
    def __init__(self, num_items, max_len, d, layers, heads, dropout=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        causal = torch.triu(torch.full((max_len, max_len), float("-inf")), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, seq):
        T = seq.size(1)
        h = self.item_emb(seq) + self.pos_emb(torch.arange(T, device=seq.device))
        h = self.encoder(self.drop(h), mask=self.causal[:T, :T], src_key_padding_mask=seq == 0)
        h = self.norm(h)
        return h @ self.item_emb.weight.t()  # tied output layer


def save_checkpoint(path, model, optimizer, step, args):
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "step": step, "args": vars(args)}
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    model = SASRec(args.num_items, args.max_len, args.d_model, args.layers, args.heads).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))

    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    start_step = 0
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_step = ck["step"]
    model = DDP(model, device_ids=[local_rank])

    files = glob.glob(os.path.join(args.data, "*.parquet"))
    ds = SequenceStream(files, rank, world, args.batch_size, args.max_len, args.seed,
                        skip_batches=start_step)
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    if rank == 0:
        print(f"{len(files)} shards, starting at step {start_step}, world {world}")

    model.train()
    it = iter(loader)
    meter = torch.zeros(3, device=device)
    t0 = time.time()
    for step in range(start_step + 1, args.max_steps + 1):
        x = next(it).to(device, non_blocking=True)
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp)
        mask = tgt != 0
        loss = F.cross_entropy(logits.float()[mask], tgt[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        with torch.no_grad():
            top10 = logits[mask].topk(10, dim=-1).indices
            hit = (top10 == tgt[mask].unsqueeze(-1)).any(-1).float().sum()
        meter += torch.stack([loss.detach() * mask.sum(), hit, mask.sum().float()])

        if step % 200 == 0:
            dist.all_reduce(meter)
            if rank == 0:
                print(f"step {step} loss {(meter[0] / meter[2]).item():.4f} "
                      f"HR@10 {(meter[1] / meter[2]).item():.4f} {(time.time() - t0) / 200 * 1000:.0f}ms/step")
            meter.zero_()
            t0 = time.time()

        if step % args.save_every == 0:
            save_checkpoint(ckpt_path, model, optimizer, step, args)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
