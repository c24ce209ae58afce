"""DPRNN-TasNet on Libri2Mix (8k, min, clean), single node, one process per GPU via mp.spawn.

python 03_dprnn_librimix_spawn.py --meta_dir /data/Libri2Mix/wav8k/min/metadata --exp exp/dprnn_libri2mix
"""
import argparse
import csv
import itertools
import json
import os
import random
import statistics

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class LibriMix(Dataset):
    def __init__(self, csv_path, segment=None, sample_rate=8000):
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.seg = None if segment is None else int(segment * sample_rate)
        if self.seg is not None:
            rows = [r for r in rows if int(r["length"]) >= self.seg]
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        start, stop = 0, None
        if self.seg is not None:
            start = random.randint(0, int(r["length"]) - self.seg)
            stop = start + self.seg
        mix = sf.read(r["mixture_path"], start=start, stop=stop, dtype="float32")[0]
        s1 = sf.read(r["source_1_path"], start=start, stop=stop, dtype="float32")[0]
        s2 = sf.read(r["source_2_path"], start=start, stop=stop, dtype="float32")[0]
        return torch.from_numpy(mix), torch.from_numpy(np.stack([s1, s2])), r["mixture_ID"]


class DPRNNBlock(nn.Module):
    def __init__(self, feat, hidden):
        super().__init__()
        self.intra_rnn = nn.LSTM(feat, hidden, batch_first=True, bidirectional=True)
        self.intra_fc = nn.Linear(2 * hidden, feat)
        self.intra_norm = nn.GroupNorm(1, feat, eps=1e-8)
        self.inter_rnn = nn.LSTM(feat, hidden, batch_first=True, bidirectional=True)
        self.inter_fc = nn.Linear(2 * hidden, feat)
        self.inter_norm = nn.GroupNorm(1, feat, eps=1e-8)

    def forward(self, x):  # B, N, K, S
        B, N, K, S = x.shape
        y = x.permute(0, 3, 2, 1).reshape(B * S, K, N)
        y = self.intra_fc(self.intra_rnn(y)[0]).reshape(B, S, K, N).permute(0, 3, 2, 1)
        x = x + self.intra_norm(y)
        y = x.permute(0, 2, 3, 1).reshape(B * K, S, N)
        y = self.inter_fc(self.inter_rnn(y)[0]).reshape(B, K, S, N).permute(0, 3, 1, 2)
        return x + self.inter_norm(y)


class DPRNNTasNet(nn.Module):
    def __init__(self, n_src=2, enc_dim=64, kernel=16, feat=128, hidden=128, chunk=100, repeats=6):
        super().__init__()
        self.n_src, self.chunk, self.hop = n_src, chunk, chunk // 2
        self.encoder = nn.Conv1d(1, enc_dim, kernel, stride=kernel // 2, bias=False)
        self.in_norm = nn.GroupNorm(1, enc_dim, eps=1e-8)
        self.bottleneck = nn.Conv1d(enc_dim, feat, 1)
        self.blocks = nn.Sequential(*[DPRNNBlock(feat, hidden) for _ in range(repeats)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv2d(feat, n_src * enc_dim, 1))
        self.decoder = nn.ConvTranspose1d(enc_dim, 1, kernel, stride=kernel // 2, bias=False)

    def forward(self, mix):
        T = mix.size(-1)
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        y = self.bottleneck(self.in_norm(w))
        B, N, L = y.shape
        gap = (self.hop - L % self.hop) % self.hop
        Lp = L + gap + 2 * self.hop
        seg = F.pad(y, (self.hop, gap + self.hop)).unfold(-1, self.chunk, self.hop).transpose(2, 3)
        m = self.mask(self.blocks(seg))  # B, n_src*E, K, S
        C = m.size(1)
        m = F.fold(m.reshape(B, C * self.chunk, -1), (1, Lp), (1, self.chunk), stride=(1, self.hop))
        m = F.relu(m.reshape(B, self.n_src, -1, Lp)[..., self.hop:self.hop + L])
        est = self.decoder((m * w.unsqueeze(1)).flatten(0, 1)).view(B, self.n_src, -1)
        return F.pad(est, (0, max(0, T - est.size(-1))))[..., :T]


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    s = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(s.pow(2).sum(-1) / (est - s).pow(2).sum(-1).clamp_min(eps) + eps)


def pit_si_snr(est, ref):
    pair = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    n = est.size(1)
    ar = torch.arange(n, device=est.device)
    return torch.stack([pair[:, ar, list(p)].mean(-1) for p in itertools.permutations(range(n))], 1).max(1).values


def run(rank, world_size, args):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    random.seed(args.seed * 100 + rank)
    torch.manual_seed(args.seed)

    train_set = LibriMix(os.path.join(args.meta_dir, "mixture_train-360_mix_clean.csv"), segment=args.segment)
    dev_set = LibriMix(os.path.join(args.meta_dir, "mixture_dev_mix_clean.csv"))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_set, range(rank, len(dev_set), world_size)), batch_size=1, num_workers=2)

    model = DDP(DPRNNTasNet().to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10)

    ckpt_file = os.path.join(args.exp, "checkpoint.pt")
    start, best, bad_epochs = 0, float("inf"), 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        plateau.load_state_dict(ck["plateau"])
        start, best, bad_epochs = ck["epoch"] + 1, ck["best"], ck["bad_epochs"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for mix, srcs, _ in train_dl:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            loss = -pit_si_snr(model(mix), srcs).mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        val = torch.zeros(2, device=device, dtype=torch.float64)
        per_utt = []
        with torch.no_grad():
            for mix, srcs, mid in dev_dl:
                mix, srcs = mix.to(device), srcs.to(device)
                score = pit_si_snr(model.module(mix), srcs)
                sisnri = (score - pit_si_snr(mix.unsqueeze(1).repeat(1, 2, 1), srcs)).item()
                val += torch.tensor([-score.item(), 1.0], device=device, dtype=torch.float64)
                per_utt.append((mid[0], sisnri))
        dist.all_reduce(tot)
        dist.all_reduce(val)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, per_utt)
        val_loss = (val[0] / val[1]).item()
        plateau.step(val_loss)

        improved = val_loss < best
        best = min(best, val_loss)
        bad_epochs = 0 if improved else bad_epochs + 1
        if rank == 0:
            all_utt = dict(itertools.chain.from_iterable(gathered))
            print(f"epoch {epoch}: train {tot[0].item() / tot[1].item():.3f}  dev {val_loss:.3f}  "
                  f"median SI-SNRi {statistics.median(all_utt.values()):.2f} dB over {len(all_utt)} utts", flush=True)
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "plateau": plateau.state_dict(),
                        "epoch": epoch, "best": best, "bad_epochs": bad_epochs}, ckpt_file)
            if improved:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
                with open(os.path.join(args.exp, "dev_sisnri.json"), "w") as f:
                    json.dump(all_utt, f, indent=1)
        dist.barrier()
        if bad_epochs >= args.early_stop:
            break

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--meta_dir", required=True)
    p.add_argument("--exp", default="exp/dprnn_libri2mix")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--segment", type=float, default=3.0)
    p.add_argument("--early_stop", type=int, default=30)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    n_gpus = torch.cuda.device_count()
    mp.spawn(run, args=(n_gpus, args), nprocs=n_gpus, join=True)
