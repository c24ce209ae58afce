"""AV transformer-CTC on the 30h LRS3 "trainval" subset (low-resource setting).

Log-mel features are computed once and cached as a single fp16 blob together with
global CMVN stats; lip ROIs are read from .npy per utterance.

    python 11_avsr_lrs3_30h_fbank_cache.py --root /data/lrs3 --ngpus 8
"""
import argparse
import math
import os
import random
import socket
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<b>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
C2I = {c: i for i, c in enumerate(VOCAB)}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--cache-dir", default=None, help="defaults to <root>/cache")
    p.add_argument("--ngpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--exp", default="exp/av_ctc_30h")
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--warmup-epochs", type=int, default=10)
    return p.parse_args()


def compute_fbank_cache(root, split, cache_file):
    """Extract 80-d log-mel for every utterance of <split> and store it with CMVN stats."""
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160, n_mels=80)
    feats, s, ss, n = {}, torch.zeros(80, dtype=torch.float64), torch.zeros(80, dtype=torch.float64), 0
    with open(os.path.join(root, f"{split}.tsv")) as f:
        for line in f:
            uid, _, wav, _ = line.rstrip("\n").split("\t")
            w, sr = torchaudio.load(os.path.join(root, wav))
            x = (mel(w[0]) + 1e-6).log().t()
            feats[uid] = x.half()
            s += x.sum(0).double()
            ss += (x.double() ** 2).sum(0)
            n += x.size(0)
    mean = s / n
    std = (ss / n - mean ** 2).clamp(min=1e-8).sqrt()
    torch.save({"feats": feats, "mean": mean.float(), "std": std.float()}, cache_file)


class AVCached(Dataset):
    def __init__(self, root, split, cache_dir):
        os.makedirs(cache_dir, exist_ok=True)
        cache_file = os.path.join(cache_dir, f"{split}_fbank80.pt")
        if not os.path.exists(cache_file):
            compute_fbank_cache(root, split, cache_file)
        blob = torch.load(cache_file, map_location="cpu")
        self.feats, self.mean, self.std = blob["feats"], blob["mean"], blob["std"]
        self.rows = []
        with open(os.path.join(root, f"{split}.tsv")) as f:
            for line in f:
                uid, roi, _, text = line.rstrip("\n").split("\t")
                self.rows.append((uid, os.path.join(root, roi), text.lower()))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, roi, text = self.rows[i]
        v = torch.from_numpy(np.load(roi)).float().div(255.0)
        a = (self.feats[uid].float() - self.mean) / self.std
        t = min(v.size(0), a.size(0) // 4)
        y = torch.tensor([C2I[c] for c in text if c in C2I])
        return (v[:t] - 0.421) / 0.165, a[: 4 * t].reshape(t, 320), y


def collate(batch):
    v, a, y = zip(*batch)
    return (pad_sequence(v, True), pad_sequence(a, True), torch.tensor([x.size(0) for x in v]),
            torch.cat(y), torch.tensor([x.numel() for x in y]))


class LipConvFront(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv3d(1, 32, (3, 5, 5), (1, 2, 2), (1, 2, 2)), nn.GroupNorm(8, 32), nn.SiLU(),
            nn.Conv3d(32, 64, (3, 3, 3), (1, 2, 2), (1, 1, 1)), nn.GroupNorm(8, 64), nn.SiLU(),
            nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), (1, 1, 1)), nn.GroupNorm(8, 128), nn.SiLU(),
            nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), (1, 1, 1)), nn.GroupNorm(8, 256), nn.SiLU())
        self.out = nn.Linear(256, d)

    def forward(self, v):
        x = self.conv(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        return self.out(x)


class AVTransformerCTC(nn.Module):
    def __init__(self, d=384, layers=12, vocab=len(VOCAB)):
        super().__init__()
        self.lip = LipConvFront(d)
        self.aud = nn.Sequential(nn.Linear(320, d), nn.LayerNorm(d))
        self.mix = nn.Linear(2 * d, d)
        self.pos = nn.Parameter(torch.randn(1, 1024, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 6, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, v, a, lens):
        x = self.mix(torch.cat([self.lip(v), self.aud(a)], -1)) + self.pos[:, : v.size(1)]
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        return self.head(self.enc(x, src_key_padding_mask=pad)).log_softmax(-1)


def decode(logp, lens):
    out = []
    for p, n in zip(logp.argmax(-1).cpu(), lens.tolist()):
        ids = torch.unique_consecutive(p[:n]).tolist()
        out.append("".join(VOCAB[i] for i in ids if i != 0))
    return out


@torch.no_grad()
def test_wer(net, loader, device):
    net.eval()
    err = tot = 0
    for v, a, lens, y, ylens in loader:
        hyps = decode(net(v.to(device), a.to(device), lens.to(device)), lens)
        refs = ["".join(VOCAB[i] for i in seg.tolist()) for seg in torch.split(y, ylens.tolist())]
        for h, r in zip(hyps, refs):
            err += editdistance.eval(h.split(), r.split())
            tot += len(r.split())
    net.train()
    return err / max(tot, 1)


def run(rank, world, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://localhost:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    random.seed(rank)
    torch.manual_seed(0)

    cache_dir = args.cache_dir or os.path.join(args.root, "cache")
    train_set = AVCached(args.root, "trainval", cache_dir)
    test_set = AVCached(args.root, "test", cache_dir)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=4, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 16, num_workers=4, collate_fn=collate)

    net = AVTransformerCTC().to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = len(loader)
    warm, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, run_loss = time.time(), 0.0
        for v, a, lens, y, ylens in loader:
            v, a, lens = v.to(device, non_blocking=True), a.to(device, non_blocking=True), lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp = model(v, a, lens)
            loss = F.ctc_loss(logp.float().transpose(0, 1), y.to(device), lens, ylens.to(device),
                              zero_infinity=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run_loss += loss.item()
        if rank == 0:
            msg = f"epoch {epoch} loss {run_loss / steps_per_epoch:.3f} ({time.time() - t0:.0f}s)"
            if epoch % 5 == 4 or epoch == args.epochs - 1:
                msg += f" test WER {100 * test_wer(net, test_loader, device):.2f}"
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.exp, f"ep{epoch}.pt"))
            print(msg, flush=True)
        dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = get_args()
    mp.spawn(run, args=(args.ngpus, free_port(), args), nprocs=args.ngpus, join=True)
