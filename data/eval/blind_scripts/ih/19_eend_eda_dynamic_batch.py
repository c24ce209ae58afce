"""EEND-EDA (end-to-end neural diarization with encoder-decoder attractors).

Trained on simulated conversations (1-4 speakers) of very different lengths,
so mini-batches are built by total frame budget rather than a fixed size.

    torchrun --nproc_per_node=8 19_eend_eda_dynamic_batch.py --train data/simu/train \
        --dev data/simu/dev --out exp/eend_eda
"""
import argparse
import itertools
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

SUBSAMPLE, CONTEXT = 10, 7


def parse_rttm(path):
    segs = {}
    for line in open(path):
        f = line.split()
        segs.setdefault(f[1], []).append((float(f[3]), float(f[3]) + float(f[4]), f[7]))
    return segs


class SimuConversations(Dataset):
    """<dir>/wav.scp, <dir>/rttm, <dir>/reco2num_frames (frames after subsampling)."""

    def __init__(self, data_dir):
        self.wavs = dict(l.split(maxsplit=1) for l in open(os.path.join(data_dir, "wav.scp")).read().splitlines())
        self.segs = parse_rttm(os.path.join(data_dir, "rttm"))
        self.recos = sorted(self.wavs)
        nf = dict(l.split() for l in open(os.path.join(data_dir, "reco2num_frames")))
        self.lengths = [int(nf[r]) for r in self.recos]
        self.mel = torchaudio.transforms.MelSpectrogram(8000, n_fft=200, hop_length=80, n_mels=23)

    def __len__(self):
        return len(self.recos)

    def __getitem__(self, i):
        reco = self.recos[i]
        wav, _ = sf.read(self.wavs[reco], dtype="float32")
        x = torch.log(self.mel(torch.from_numpy(wav)) + 1e-6).T  # (T, 23)
        x = x - x.mean(0, keepdim=True)
        x = F.pad(x.T, (CONTEXT, CONTEXT), mode="replicate").T
        x = x.unfold(0, 2 * CONTEXT + 1, 1).reshape(-1, 23 * (2 * CONTEXT + 1))[::SUBSAMPLE]
        spks = sorted({s for _, _, s in self.segs[reco]})
        y = torch.zeros(x.size(0), len(spks))
        for st, en, s in self.segs[reco]:
            a, b = int(st * 100 / SUBSAMPLE), int(math.ceil(en * 100 / SUBSAMPLE))
            y[a:b, spks.index(s)] = 1.0
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    T = max(x.size(0) for x in xs)
    S = max(y.size(1) for y in ys)
    X = torch.zeros(len(xs), T, xs[0].size(1))
    Y = torch.zeros(len(xs), T, S)
    lens = torch.tensor([x.size(0) for x in xs])
    nspk = torch.tensor([y.size(1) for y in ys])
    for b, (x, y) in enumerate(zip(xs, ys)):
        X[b, : x.size(0)] = x
        Y[b, : y.size(0), : y.size(1)] = y
    return X, Y, lens, nspk


class FrameBudgetSampler(Sampler):
    """Length-sorted batches holding at most `max_frames` padded frames each."""

    def __init__(self, lengths, max_frames, rank, world, seed=0):
        self.lengths, self.max_frames = lengths, max_frames
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        mine = sorted(perm[self.rank::self.world], key=lambda i: self.lengths[i])
        batches, cur, longest = [], [], 0
        for i in mine:
            L = self.lengths[i]
            if cur and max(longest, L) * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, L)
        if cur:
            batches.append(cur)
        random.Random(self.seed + self.epoch).shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class EENDEDA(nn.Module):
    def __init__(self, in_dim=345, d=256, heads=4, layers=4, ff=1024, max_spk=4):
        super().__init__()
        self.max_spk = max_spk
        self.inp = nn.Sequential(nn.Linear(in_dim, d), nn.LayerNorm(d))
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.eda_enc = nn.LSTM(d, d, batch_first=True)
        self.eda_dec = nn.LSTM(d, d, batch_first=True)
        self.exist = nn.Linear(d, 1)

    def forward(self, X, lens, nspk=None):
        mask = torch.arange(X.size(1), device=X.device)[None] >= lens[:, None]
        emb = self.encoder(self.inp(X), src_key_padding_mask=mask)
        outs = []
        for b in range(X.size(0)):
            e = emb[b, : lens[b]]
            shuffled = e[torch.randperm(e.size(0), device=e.device)] if self.training else e
            _, state = self.eda_enc(shuffled[None])
            n = int(nspk[b]) if nspk is not None else self.max_spk
            attractors, _ = self.eda_dec(e.new_zeros(1, n + 1, e.size(1)), state)
            attractors = attractors[0]
            outs.append((e @ attractors[:n].T, self.exist(attractors).squeeze(-1)))
        return outs


def pit_bce(logits, labels):
    n = labels.size(1)
    best = None
    for perm in itertools.permutations(range(n)):
        loss = F.binary_cross_entropy_with_logits(logits[:, list(perm)], labels)
        best = loss if best is None or loss < best else best
    return best


def eda_loss(outs, Y, lens, nspk):
    diar, attr = 0.0, 0.0
    for (logits, exist), y, L, n in zip(outs, Y, lens.tolist(), nspk.tolist()):
        diar = diar + pit_bce(logits, y[:L, :n])
        target = torch.cat([torch.ones(n), torch.zeros(1)]).to(exist.device)
        attr = attr + F.binary_cross_entropy_with_logits(exist, target)
    return diar / len(outs), attr / len(outs)


@torch.no_grad()
def frame_der(model, dataset, device, rank, world):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # miss, fa, conf, ref
    for i in range(rank, len(dataset), world):
        x, y = dataset[i]
        (logits, exist), = model(x[None].to(device), torch.tensor([x.size(0)], device=device))
        n_hat = int((torch.sigmoid(exist) > 0.5).long().cumprod(0).sum())
        hyp = (torch.sigmoid(logits[:, :n_hat]) > 0.5).float()
        ref = y.to(device)
        S = max(ref.size(1), hyp.size(1))
        ref = F.pad(ref, (0, S - ref.size(1)))
        hyp = F.pad(hyp, (0, S - hyp.size(1)))
        best = None
        for perm in itertools.permutations(range(S)):
            h = hyp[:, list(perm)]
            n_ref, n_sys = ref.sum(1), h.sum(1)
            miss = (n_ref - n_sys).clamp(min=0).sum()
            fa = (n_sys - n_ref).clamp(min=0).sum()
            conf = (torch.minimum(n_ref, n_sys) - (ref * h).sum(1)).sum()
            cand = torch.stack([miss, fa, conf, n_ref.sum()]).double()
            if best is None or cand[:3].sum() < best[:3].sum():
                best = cand
        stats += best
    dist.all_reduce(stats)
    return (100 * stats[:3].sum() / stats[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", default="exp/eend_eda")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--max-frames", type=int, default=320000, help="padded frames per global batch")
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=100000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = SimuConversations(args.train)
    dev = SimuConversations(args.dev)
    sampler = FrameBudgetSampler(train.lengths, args.max_frames // world, rank, world)
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate, num_workers=8, pin_memory=True)

    model = EENDEDA().to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    d_model = 256
    noam = lambda s: d_model ** -0.5 * min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tot = torch.zeros(3, device=device)
        for X, Y, lens, nspk in loader:
            X, Y, lens = X.to(device, non_blocking=True), Y.to(device, non_blocking=True), lens.to(device)
            outs = ddp(X, lens, nspk)
            l_diar, l_attr = eda_loss(outs, Y, lens, nspk)
            loss = l_diar + l_attr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            sched.step()
            tot += torch.stack([l_diar.detach(), l_attr.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        der = frame_der(model, dev, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} diar {tot[0] / tot[2]:.4f} attr {tot[1] / tot[2]:.4f} dev DER {der:.2f}%",
                  flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "opt": opt.state_dict()},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
