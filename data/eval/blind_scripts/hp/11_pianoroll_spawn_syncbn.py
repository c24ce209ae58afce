"""Polyphonic piano-roll model (JSB Chorales / Piano-midi.de / Nottingham / MuseData pickles
of Boulanger-Lewandowski et al. 2012): causal conv front-end + transformer, next-frame
Bernoulli prediction over 88 keys.

Single node, one process per GPU started with torch.multiprocessing:
    python 11_pianoroll_spawn_syncbn.py --data data/Piano-midi.de.pickle --gpus 4
"""
import argparse
import os
import pickle
import socket

import numpy as np
import pretty_midi
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LOW, N_KEYS = 21, 88


def to_roll(seq):
    roll = np.zeros((len(seq), N_KEYS), dtype=np.float32)
    for t, notes in enumerate(seq):
        for p in notes:
            if LOW <= p < LOW + N_KEYS:
                roll[t, p - LOW] = 1.0
    return roll


class RollWindows(Dataset):
    def __init__(self, seqs, length, hop):
        self.windows = []
        for s in seqs:
            r = to_roll(s)
            if len(r) < length + 1:
                r = np.pad(r, ((0, length + 1 - len(r)), (0, 0)))
            for st in range(0, len(r) - length, hop):
                self.windows.append(r[st:st + length + 1])

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return torch.from_numpy(self.windows[i])


class CausalConv(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.pad = k - 1
        self.conv = nn.Conv1d(cin, cout, k)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):  # [B, C, T]
        return F.gelu(self.bn(self.conv(F.pad(x, (self.pad, 0)))))


class RollTransformer(nn.Module):
    def __init__(self, d=384, layers=6, heads=6, max_len=1024):
        super().__init__()
        self.front = nn.Sequential(CausalConv(N_KEYS, d, 5), CausalConv(d, d, 5))
        self.pos = nn.Embedding(max_len, d)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, N_KEYS)

    def forward(self, roll):  # [B, T, 88] -> logits for frames 1..T
        h = self.front(roll.transpose(1, 2)).transpose(1, 2)
        T = h.size(1)
        h = h + self.pos(torch.arange(T, device=h.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=h.device)
        return self.out(self.tf(h, mask=mask, is_causal=True))


def frame_nll(logits, target):
    # negative log-likelihood per frame, summed over the 88 keys (the usual metric for these sets)
    return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1)


@torch.no_grad()
def sample_rolls(model, n, frames, device, primer):
    x = primer.to(device)[None].repeat(n, 1, 1)
    for _ in range(frames):
        p = torch.sigmoid(model(x)[:, -1])
        x = torch.cat([x, torch.bernoulli(p)[:, None]], 1)
    return x.cpu().numpy()


def roll_to_midi(roll, path, fs=4):
    pm = pretty_midi.PrettyMIDI(initial_tempo=90)
    inst = pretty_midi.Instrument(0)
    T = len(roll)
    for k in range(N_KEYS):
        on = None
        for t in range(T + 1):
            active = t < T and roll[t, k] > 0.5
            if active and on is None:
                on = t
            elif not active and on is not None:
                inst.notes.append(pretty_midi.Note(80, LOW + k, on / fs, t / fs))
                on = None
    pm.instruments.append(inst)
    pm.write(path)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    with open(args.data, "rb") as f:
        splits = pickle.load(f)
    train_ds = RollWindows(splits["train"], args.length, args.hop)
    valid_ds = RollWindows(splits["valid"], args.length, args.length)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world_size)),
                          batch_size=args.batch_size)

    model = RollTransformer(max_len=args.length)
    # per-GPU batches are small (16 windows), so BatchNorm statistics are synchronised
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)
    start = 0
    ckpt_file = os.path.join(args.out, "last.pt")
    if args.resume and os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        ddp.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for roll in train_dl:
            roll = roll.to(device, non_blocking=True)
            logits = ddp(roll[:, :-1])
            loss = frame_nll(logits, roll[:, 1:]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            sched.step()

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for roll in valid_dl:
                roll = roll.to(device)
                acc[0] += frame_nll(model(roll[:, :-1]), roll[:, 1:]).sum()
                acc[1] += roll[:, 1:].shape[0] * roll[:, 1:].shape[1]
        dist.all_reduce(acc)
        val_nll = (acc[0] / acc[1]).item()

        if rank == 0:
            print(f"epoch {epoch:3d} train {loss.item():.3f} valid NLL/frame {val_nll:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_file)
            if epoch % 10 == 9:
                # eval-mode BatchNorm uses running statistics: no collective, safe on one rank
                rolls = sample_rolls(model, 2, args.length - 32, device, valid_ds[0][:32])
                for i, r in enumerate(rolls):
                    roll_to_midi(r, os.path.join(args.out, f"sample_e{epoch}_{i}.mid"))
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/pianoroll")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--hop", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    assert 1 <= args.gpus <= torch.cuda.device_count(), "more processes than visible GPUs"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
