"""Dual-path transformer separator on wsj0-2mix with activation checkpointing, wandb logging and
per-utterance test report.

    torchrun --standalone --nproc_per_node=8 20_dptransformer_ckpt_wsj0mix.py \
        --data /data/wsj0-2mix/wav8k/min --exp exp/dpt_ckpt --grad_ckpt
"""
import argparse
import itertools
import json
import math
import os
import random
import statistics

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class Wsj0Mix(Dataset):
    def __init__(self, split_dir, segment=None, sr=8000):
        self.dir = split_dir
        self.seg = int(segment * sr) if segment else None
        names = sorted(os.listdir(os.path.join(split_dir, "mix")))
        if self.seg:
            names = [n for n in names if sf.info(os.path.join(split_dir, "mix", n)).frames >= self.seg]
        self.names = names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        kw = dict(dtype="float32")
        if self.seg:
            n = sf.info(os.path.join(self.dir, "mix", name)).frames
            o = random.randint(0, n - self.seg)
            kw.update(start=o, stop=o + self.seg)
        mix = sf.read(os.path.join(self.dir, "mix", name), **kw)[0]
        srcs = np.stack([sf.read(os.path.join(self.dir, s, name), **kw)[0] for s in ("s1", "s2")])
        return torch.from_numpy(mix), torch.from_numpy(srcs), name


def sinusoid(length, d, device):
    pos = torch.arange(length, device=device).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, device=device) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d, device=device)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


class DPBlock(nn.Module):
    def __init__(self, d=128, nhead=4, ff=512, layers=2):
        super().__init__()
        mk = lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, nhead, ff, dropout=0.1, batch_first=True, norm_first=True), layers)
        self.intra, self.inter = mk(), mk()
        self.n1, self.n2 = nn.GroupNorm(1, d, eps=1e-8), nn.GroupNorm(1, d, eps=1e-8)

    def forward(self, x):  # B, N, K, S
        B, N, K, S = x.shape
        y = x.permute(0, 3, 2, 1).reshape(B * S, K, N)
        y = self.intra(y + sinusoid(K, N, y.device)).reshape(B, S, K, N).permute(0, 3, 2, 1)
        x = x + self.n1(y)
        y = x.permute(0, 2, 3, 1).reshape(B * K, S, N)
        y = self.inter(y + sinusoid(S, N, y.device)).reshape(B, K, S, N).permute(0, 3, 1, 2)
        return x + self.n2(y)


class DPTSeparator(nn.Module):
    def __init__(self, n_src=2, enc=256, L=16, d=128, chunk=100, blocks=6, grad_ckpt=False):
        super().__init__()
        self.n_src, self.chunk, self.hop, self.grad_ckpt = n_src, chunk, chunk // 2, grad_ckpt
        self.encoder = nn.Conv1d(1, enc, L, L // 2, bias=False)
        self.pre = nn.Sequential(nn.GroupNorm(1, enc, eps=1e-8), nn.Conv1d(enc, d, 1))
        self.blocks = nn.ModuleList([DPBlock(d) for _ in range(blocks)])
        self.post = nn.Sequential(nn.PReLU(), nn.Conv2d(d, n_src * enc, 1))
        self.decoder = nn.ConvTranspose1d(enc, 1, L, L // 2, bias=False)

    def forward(self, mix):
        T = mix.size(-1)
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        y = self.pre(w)
        B, N, Lf = y.shape
        gap = (self.hop - Lf % self.hop) % self.hop
        Lp = Lf + gap + 2 * self.hop
        x = F.pad(y, (self.hop, gap + self.hop)).unfold(-1, self.chunk, self.hop).transpose(2, 3)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        m = self.post(x)
        m = F.fold(m.reshape(B, -1, m.size(-1)), (1, Lp), (1, self.chunk), stride=(1, self.hop))
        m = F.relu(m.reshape(B, self.n_src, -1, Lp)[..., self.hop:self.hop + Lf])
        est = self.decoder((m * w.unsqueeze(1)).flatten(0, 1)).view(B, self.n_src, -1)
        return F.pad(est, (0, max(0, T - est.size(-1))))[..., :T]


def si_snr(e, r, eps=1e-8):
    e, r = e - e.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    s = (e * r).sum(-1, keepdim=True) * r / (r.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((e - s).pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    pw = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    a = torch.arange(est.size(1), device=est.device)
    return torch.stack([pw[:, a, list(p)].mean(-1) for p in itertools.permutations(range(est.size(1)))], 1).amax(1)


@torch.no_grad()
def score_split(net, dataset, device, rank, world):
    net.eval()
    results = {}
    for i in range(rank, len(dataset), world):
        mix, srcs, name = dataset[i]
        mix, srcs = mix[None].to(device), srcs[None].to(device)
        est = net(mix)
        baseline = pit_si_snr(mix.unsqueeze(1).expand(-1, net.n_src, -1), srcs)
        results[name] = (pit_si_snr(est, srcs) - baseline).item()
    shards = [None] * world
    dist.all_gather_object(shards, results)
    merged = {}
    for s in shards:
        merged.update(s)
    return merged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", default="exp/dpt_ckpt")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU (global = 4 x world size)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--wandb_project", default="dpt-wsj0mix")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tr = Wsj0Mix(os.path.join(args.data, "tr"), segment=4.0)
    cv = Wsj0Mix(os.path.join(args.data, "cv"))
    tt = Wsj0Mix(os.path.join(args.data, "tt"))
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                       drop_last=True)

    model = DDP(DPTSeparator(grad_ckpt=args.grad_ckpt).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    total_steps = args.epochs * len(tr_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05)

    ckpt_path = os.path.join(args.exp, "last.pt")
    start_epoch, best = 0, -1e9
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    run = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        run = wandb.init(project=args.wandb_project, config=vars(args), dir=args.exp, resume="allow")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for mix, srcs, _ in tr_dl:
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            loss = -pit_si_snr(model(mix), srcs).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        cv_scores = score_split(model.module, cv, device, rank, world)
        cv_mean = statistics.fmean(cv_scores.values())
        if rank == 0:
            run.log({"epoch": epoch, "train/loss": (running[0] / running[1]).item(), "cv/si_snri": cv_mean,
                     "lr": sched.get_last_lr()[0]})
            best = max(best, cv_mean)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path)
            if best == cv_mean:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.exp, "best.pt"), map_location=device))
    tt_scores = score_split(model.module, tt, device, rank, world)
    if rank == 0:
        vals = list(tt_scores.values())
        summary = {"n": len(vals), "mean": statistics.fmean(vals), "median": statistics.median(vals),
                   "p10": float(np.percentile(vals, 10))}
        with open(os.path.join(args.exp, "tt_sisnri.json"), "w") as f:
            json.dump({"summary": summary, "per_utt": tt_scores}, f, indent=1)
        run.summary.update({f"tt/{k}": v for k, v in summary.items()})
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
