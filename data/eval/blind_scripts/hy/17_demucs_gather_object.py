"""Waveform U-Net with a Transformer bottleneck (Demucs-like), DDP training with per-track
SDR report on the MUSDB18-HQ test set (median over 1 s frames, as in SiSEC18).

    torchrun --nproc_per_node=8 17_demucs_gather_object.py --musdb /data/musdb18hq --out exp/tdemucs
"""
import argparse
import json
import math
import os
import random
import statistics
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TransformerDemucs(nn.Module):
    def __init__(self, sources, channels=48, depth=5, kernel=8, stride=4, t_layers=4, heads=8,
                 samplerate=44100, segment=6.0, grad_ckpt=True):
        super().__init__()
        self.sources, self.samplerate, self.segment = list(sources), samplerate, segment
        self.depth, self.kernel, self.stride, self.grad_ckpt = depth, kernel, stride, grad_ckpt
        self.enc, self.dec = nn.ModuleList(), nn.ModuleList()
        cin, ch = 2, channels
        for i in range(depth):
            self.enc.append(nn.Sequential(nn.Conv1d(cin, ch, kernel, stride), nn.GELU(),
                                          nn.Conv1d(ch, 2 * ch, 1), nn.GLU(1)))
            cout = 2 * len(sources) if i == 0 else cin
            layers = [nn.Conv1d(ch, 2 * ch, 3, padding=1), nn.GLU(1), nn.ConvTranspose1d(ch, cout, kernel, stride)]
            if i > 0:
                layers.append(nn.GELU())
            self.dec.insert(0, nn.Sequential(*layers))
            cin, ch = ch, 2 * ch
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(cin, heads, 4 * cin, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(t_layers))

    def valid_length(self, n):
        for _ in range(self.depth):
            n = max(1, math.ceil((n - self.kernel) / self.stride) + 1)
        for _ in range(self.depth):
            n = (n - 1) * self.stride + self.kernel
        return n

    def forward(self, mix):
        n = mix.shape[-1]
        mono = mix.mean(1, keepdim=True)
        mean, std = mono.mean(-1, keepdim=True), mono.std(-1, keepdim=True) + 1e-5
        x = (mix - mean) / std
        pad = self.valid_length(n) - n
        x = F.pad(x, (pad // 2, pad - pad // 2))
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
        x = x.transpose(1, 2)
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        x = x.transpose(1, 2)
        for d in self.dec:
            x = d(x + skips.pop())
        x = x[..., pad // 2: pad // 2 + n].reshape(mix.shape[0], len(self.sources), 2, n)
        return x * std[:, None] + mean[:, None]


class RemixSet(Dataset):
    def __init__(self, tracks, sources, seconds, items, sr=44100):
        self.tracks, self.sources, self.items = tracks, sources, items
        self.n = int(seconds * sr)
        self.frames = [sf.info(str(t / "mixture.wav")).frames for t in tracks]
        self.epoch = 0

    def __len__(self):
        return self.items

    def __getitem__(self, i):
        rng = random.Random((self.epoch << 32) + i)
        stems = []
        for src in self.sources:
            k = rng.randrange(len(self.tracks))
            off = rng.randint(0, max(0, self.frames[k] - self.n))
            x, _ = sf.read(str(self.tracks[k] / f"{src}.wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
            x = np.pad(x, ((0, self.n - len(x)), (0, 0))).T * rng.uniform(0.25, 1.25)
            stems.append(x[::-1] if rng.random() < 0.5 else x)
        return torch.from_numpy(np.ascontiguousarray(np.stack(stems), dtype=np.float32))


@torch.no_grad()
def separate(net, mix, device, overlap=0.25, batch=8):
    seg = int(net.segment * net.samplerate)
    hop = int(seg * (1 - overlap))
    T = mix.shape[-1]
    starts = list(range(0, max(1, T - seg + hop), hop))
    total = starts[-1] + seg
    x = F.pad(mix, (0, total - T))
    w = torch.cat([torch.arange(1, seg // 2 + 1), torch.arange(seg - seg // 2, 0, -1)]).float()
    w = w / w.max()
    out = torch.zeros(len(net.sources), 2, total)
    norm = torch.zeros(total)
    for i in range(0, len(starts), batch):
        ss = starts[i:i + batch]
        y = net(torch.stack([x[:, s:s + seg] for s in ss]).to(device)).cpu()
        for s, yy in zip(ss, y):
            out[..., s:s + seg] += yy * w
            norm[s:s + seg] += w
    return (out / norm)[..., :T]


def framewise_sdr(ref, est, win=44100):
    """Median over 1 s frames of the per-frame SDR (frames with silent reference are skipped)."""
    vals = []
    for s in range(0, ref.shape[-1] - win + 1, win):
        r, e = ref[..., s:s + win], est[..., s:s + win]
        num = float((r ** 2).sum())
        if num < 1e-8:
            continue
        vals.append(10 * math.log10(num / max(float(((r - e) ** 2).sum()), 1e-12)))
    return statistics.median(vals) if vals else float("nan")


def test_report(model, tracks, device):
    net = model.module
    net.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = []
    for t in tracks[rank::world]:
        refs = np.stack([sf.read(str(t / f"{s}.wav"), dtype="float32", always_2d=True)[0].T for s in net.sources])
        est = separate(net, torch.from_numpy(refs.sum(0)), device).numpy()
        local.append({"track": t.name, **{s: framewise_sdr(refs[i], est[i]) for i, s in enumerate(net.sources)}})
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    net.train()
    return [row for part in gathered for row in part]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--musdb", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("exp/tdemucs"))
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--items", type=int, default=16000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--test-every", type=int, default=25)
    ap.add_argument("--init", type=Path, default=None, help="state dict to start from")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    sources = ["drums", "bass", "other", "vocals"]
    torch.manual_seed(0)
    net = TransformerDemucs(sources)
    if args.init is not None:
        net.load_state_dict(torch.load(args.init, map_location="cpu"))
    net.to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)

    train_tracks = sorted(p for p in (args.musdb / "train").iterdir() if p.is_dir())
    test_tracks = sorted(p for p in (args.musdb / "test").iterdir() if p.is_dir())
    ds = RemixSet(train_tracks, model.module.sources, model.module.segment, args.items)
    sampler = DistributedSampler(ds, seed=0)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ds.epoch = epoch
        tot = torch.zeros(2, device=device)
        for stems in dl:
            stems = stems.to(device, non_blocking=True)
            loss = F.l1_loss(model(stems.sum(1)), stems)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} l1 {(tot[0] / tot[1]).item():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       args.out / "last.th")

        if (epoch + 1) % args.test_every == 0:
            rows = test_report(model, test_tracks, device)
            if rank == 0:
                with open(args.out / f"test_epoch{epoch:03d}.json", "w") as f:
                    json.dump(rows, f, indent=1)
                med = {s: statistics.median(r[s] for r in rows if not math.isnan(r[s])) for s in sources}
                print("test median SDR " + " ".join(f"{s}={v:.2f}" for s, v in med.items()), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
