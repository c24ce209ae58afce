"""Stereo Conv-TasNet for 4-stem music separation (MUSDB18-HQ), random-remix training, DDP.

Checkpoints go to --ckpt-dir on the shared filesystem so a pre-empted job can pick up where
it left off:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        15_conv_tasnet_music.py --musdb /shared/musdb18hq --ckpt-dir /shared/exp/tasnet4
"""
import argparse
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SOURCES = ("drums", "bass", "other", "vocals")


class cLN(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.GroupNorm(1, dim, eps=1e-8)

    def forward(self, x):
        return self.norm(x)


class DepthConv(nn.Module):
    def __init__(self, b, h, dilation, last=False):
        super().__init__()
        self.conv1 = nn.Conv1d(b, h, 1)
        self.act1, self.norm1 = nn.PReLU(), cLN(h)
        self.dconv = nn.Conv1d(h, h, 3, dilation=dilation, padding=dilation, groups=h)
        self.act2, self.norm2 = nn.PReLU(), cLN(h)
        self.res = None if last else nn.Conv1d(h, b, 1)
        self.skip = nn.Conv1d(h, b, 1)

    def forward(self, x):
        y = self.norm1(self.act1(self.conv1(x)))
        y = self.norm2(self.act2(self.dconv(y)))
        return (x if self.res is None else x + self.res(y)), self.skip(y)


class ConvTasNet(nn.Module):
    def __init__(self, n_src=4, channels=2, N=512, L=40, B=256, H=512, X=8, R=3):
        super().__init__()
        self.n_src, self.channels, self.N, self.L = n_src, channels, N, L
        self.encoder = nn.Conv1d(channels, N, L, stride=L // 2, bias=False)
        self.ln = cLN(N)
        self.bottleneck = nn.Conv1d(N, B, 1)
        self.tcn = nn.ModuleList(DepthConv(B, H, 2 ** x, last=(r == R - 1 and x == X - 1))
                                 for r in range(R) for x in range(X))
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(B, n_src * N, 1))
        self.decoder = nn.ConvTranspose1d(N, channels, L, stride=L // 2, bias=False)

    def forward(self, mix):
        B, C, T = mix.shape
        stride = self.L // 2
        rest = (stride - (T - self.L) % stride) % stride if T > self.L else self.L - T
        x = F.pad(mix, (0, rest))
        w = F.relu(self.encoder(x))
        y = self.bottleneck(self.ln(w))
        skip_sum = 0
        for layer in self.tcn:
            y, s = layer(y)
            skip_sum = skip_sum + s
        m = torch.sigmoid(self.mask(skip_sum)).view(B, self.n_src, self.N, -1)
        est = self.decoder((w.unsqueeze(1) * m).view(B * self.n_src, self.N, -1))
        return est[..., :T].reshape(B, self.n_src, C, T)


class Remix(Dataset):
    def __init__(self, tracks, seconds, n_items, sr=44100):
        self.tracks, self.n_items = tracks, n_items
        self.len = int(seconds * sr)
        self.frames = [sf.info(os.path.join(t, "mixture.wav")).frames for t in tracks]

    def __len__(self):
        return self.n_items

    def __getitem__(self, idx):
        stems = np.zeros((len(SOURCES), 2, self.len), dtype=np.float32)
        for i, src in enumerate(SOURCES):
            k = random.randrange(len(self.tracks))
            start = random.randint(0, max(0, self.frames[k] - self.len))
            x, _ = sf.read(os.path.join(self.tracks[k], src + ".wav"), start=start, frames=self.len,
                           dtype="float32", always_2d=True)
            stems[i, :, :len(x)] = x.T * random.uniform(0.25, 1.25)
            if random.random() < 0.5:
                stems[i] = stems[i, ::-1]
        return torch.from_numpy(stems)


def sisdr_loss(est, ref, eps=1e-8):
    ref = ref - ref.mean(-1, keepdim=True)
    est = est - est.mean(-1, keepdim=True)
    alpha = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps)
    target = alpha * ref
    return -(10 * torch.log10(target.pow(2).sum(-1) / ((est - target).pow(2).sum(-1) + eps) + eps)).mean()


@torch.no_grad()
def evaluate(net, tracks, device, rank, world, seg=44100 * 10):
    net.eval()
    acc = torch.zeros(len(SOURCES) + 1, device=device)
    for t in tracks[rank::world]:
        refs = np.stack([sf.read(os.path.join(t, s + ".wav"), dtype="float32", always_2d=True)[0].T for s in SOURCES])
        refs = torch.from_numpy(refs)
        mix = refs.sum(0)
        T = mix.shape[-1]
        hop = seg // 2
        n = max(1, math.ceil((T - seg) / hop) + 1)
        mix_p = F.pad(mix, (0, (n - 1) * hop + seg - T))
        win = torch.hann_window(seg, periodic=False).clamp_min(1e-3)
        out = torch.zeros(len(SOURCES), 2, mix_p.shape[-1])
        norm = torch.zeros(mix_p.shape[-1])
        for i in range(n):
            s = i * hop
            out[..., s:s + seg] += net(mix_p[None, :, s:s + seg].to(device))[0].cpu() * win
            norm[s:s + seg] += win
        est = (out / norm)[..., :T]
        num = refs.pow(2).sum((-2, -1))
        den = (refs - est).pow(2).sum((-2, -1)).clamp_min(1e-9)
        acc[:-1] += (10 * torch.log10(num / den)).to(device)
        acc[-1] += 1
    dist.all_reduce(acc)
    net.train()
    return acc[:-1] / acc[-1]


def save_checkpoint(path, net, opt, sched, epoch, best):
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "best": best}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--musdb", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_dir = os.path.join(args.musdb, "train")
    valid_names = {l.strip() for l in open(os.path.join(args.musdb, "valid_tracks.txt")) if l.strip()}
    all_tracks = sorted(os.path.join(train_dir, d) for d in os.listdir(train_dir))
    train_tracks = [t for t in all_tracks if os.path.basename(t) not in valid_names]
    valid_tracks = [t for t in all_tracks if os.path.basename(t) in valid_names]

    ds = Remix(train_tracks, args.seconds, args.items)
    sampler = DistributedSampler(ds)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, worker_init_fn=lambda w: random.seed(torch.initial_seed() + 7 * rank))

    net = ConvTasNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    best_path = os.path.join(args.ckpt_dir, "best.pt")
    start_epoch, best = 0, -float("inf")
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for stems in dl:
            stems = stems.to(device, non_blocking=True)
            est = model(stems.sum(1))
            loss = sisdr_loss(est, stems)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} neg-SI-SDR {(run[0] / run[1]).item():.3f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            sdr = evaluate(net, valid_tracks, device, rank, world)
            score = sdr.mean().item()
            sched.step(score)
            if rank == 0:
                print("  valid SDR " + " ".join(f"{s}:{v:.2f}" for s, v in zip(SOURCES, sdr.tolist())), flush=True)
            if score > best:
                best = score
                torch.save(net.state_dict(), best_path)
        save_checkpoint(last_path, net, opt, sched, epoch, best)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
