"""Conv-Transformer magnitude-mask denoiser, single node, started with mp.spawn.

    python 13_conv_transformer_se.py --gpus 4 --speech /data/speech --noise /data/noise

A manifest of all speech/noise files with their durations is built once and
cached next to the experiment; speakers are split into train/valid with a fixed
seed. Validation utterances are mixed deterministically and enhanced at full
length in 8 s windows (attention cost grows with length).
"""
import argparse
import json
import os
import random
from datetime import timedelta
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR, N_FFT, HOP = 16000, 512, 128


def build_manifest(speech_root, noise_root, path):
    def scan(root, ext):
        out = []
        for f in sorted(Path(root).rglob(f"*.{ext}")):
            info = sf.info(str(f))
            if info.samplerate == SR and info.frames >= SR:
                out.append({"path": str(f), "frames": info.frames, "spk": f.parent.parent.name})
        return out
    manifest = {"speech": scan(speech_root, "flac"), "noise": scan(noise_root, "wav")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path)


def mix_snr(clean, noise, snr):
    k = np.sqrt((clean ** 2).sum() / ((noise ** 2).sum() + 1e-9) / 10 ** (snr / 10))
    return (clean + k * noise).astype(np.float32)


def read_segment(entry, n, rng):
    if entry["frames"] <= n:
        x, _ = sf.read(entry["path"], dtype="float32")
        return np.resize(x, n)
    st = rng.randint(0, entry["frames"] - n)
    return sf.read(entry["path"], start=st, frames=n, dtype="float32")[0]


class TrainMix(Dataset):
    def __init__(self, speech, noise, seconds=4.0, snr=(-5.0, 20.0)):
        self.speech, self.noise = speech, noise
        self.n, self.snr = int(seconds * SR), snr

    def __len__(self):
        return len(self.speech)

    def __getitem__(self, i):
        clean = read_segment(self.speech[i], self.n, random)
        noise = read_segment(random.choice(self.noise), self.n, random)
        return torch.from_numpy(mix_snr(clean, noise, random.uniform(*self.snr))), torch.from_numpy(clean)


class ConvTransformer(nn.Module):
    def __init__(self, d_model=256, layers=6, heads=4):
        super().__init__()
        f = N_FFT // 2 + 1
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.front = nn.Sequential(nn.Conv1d(f, d_model, 3, padding=1), nn.GroupNorm(1, d_model), nn.GELU(),
                                   nn.Conv1d(d_model, d_model, 3, padding=1))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.mask = nn.Linear(d_model, f)

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)
        feat = torch.log1p(spec.abs())
        h = self.encoder(self.front(feat).transpose(1, 2))
        mask = torch.sigmoid(self.mask(h)).transpose(1, 2)
        return torch.istft(spec * mask, N_FFT, HOP, window=self.window, length=wav.shape[-1])


class MRSTFTLoss(nn.Module):
    def __init__(self, cfgs=((1024, 256), (512, 128), (256, 64))):
        super().__init__()
        self.cfgs = cfgs
        for n, _ in cfgs:
            self.register_buffer(f"w{n}", torch.hann_window(n), persistent=False)

    def forward(self, est, ref):
        loss = 0.0
        for n, h in self.cfgs:
            w = getattr(self, f"w{n}")
            E = torch.stft(est, n, h, window=w, return_complex=True).abs() + 1e-7
            R = torch.stft(ref, n, h, window=w, return_complex=True).abs() + 1e-7
            loss = loss + (R - E).norm() / R.norm() + F.l1_loss(E.log(), R.log())
        return loss / len(self.cfgs)


@torch.no_grad()
def enhance_windows(net, wav, win=8 * SR, ctx=SR):
    out = torch.empty_like(wav)
    for st in range(0, wav.numel(), win):
        a, b = max(st - ctx, 0), min(st + win + ctx, wav.numel())
        y = net(wav[a:b][None])[0]
        out[st:min(st + win, wav.numel())] = y[st - a:st - a + min(win, wav.numel() - st)]
    return out


@torch.no_grad()
def validate(net, valid, noise, rank, world, device):
    net.eval()
    acc = torch.zeros(3, device=device)
    for i in range(rank, len(valid), world):
        rng = random.Random(i)
        clean = sf.read(valid[i]["path"], dtype="float32")[0]
        n = read_segment(noise[rng.randrange(len(noise))], len(clean), rng)
        noisy = mix_snr(clean, n, rng.choice([0.0, 5.0, 10.0]))
        est = enhance_windows(net, torch.from_numpy(noisy).to(device)).cpu().numpy()
        acc[0] += pesq(SR, clean, est, "wb")
        acc[1] += stoi(clean, est, SR)
        acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    # the first run scans the whole corpus on rank 0 while the others sit in barrier()
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(hours=2))
    device = torch.device("cuda", rank)
    exp = Path(args.exp)

    manifest_path = exp / "manifest.json"
    if rank == 0:
        exp.mkdir(parents=True, exist_ok=True)
        if not manifest_path.exists():
            build_manifest(args.speech, args.noise, manifest_path)
    dist.barrier()
    manifest = json.loads(manifest_path.read_text())

    # speaker split must be identical on every rank -> private RNG with a fixed seed
    speakers = sorted({e["spk"] for e in manifest["speech"]})
    random.Random(args.seed).shuffle(speakers)
    valid_spk = set(speakers[: args.valid_speakers])
    train = [e for e in manifest["speech"] if e["spk"] not in valid_spk]
    valid = [e for e in manifest["speech"] if e["spk"] in valid_spk][: args.valid_utts]

    # augmentation (noise choice, SNR, crop) should differ between GPUs; the DataLoader
    # derives its worker seeds from torch's RNG. DDP broadcasts rank 0's initial weights.
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    ds = TrainMix(train, manifest["noise"])
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = ConvTransformer().to(device)
    model = DDP(net, device_ids=[rank])
    crit = MRSTFTLoss().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    total_steps = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / total_steps))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (noisy, clean) in enumerate(dl):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            est = model(noisy)
            loss = crit(est, clean) + 0.5 * F.l1_loss(est, clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}:{step}] loss={loss.item():.4f} lr={sched.get_last_lr()[0]:.2e}", flush=True)

        p, s = validate(net, valid, manifest["noise"], rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch}: PESQ={p:.3f} STOI={s:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, exp / "last.pt")
            if p > best:
                best = p
                torch.save(net.state_dict(), exp / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--speech", required=True)
    ap.add_argument("--noise", required=True)
    ap.add_argument("--exp", default="exp/conv_transformer")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--valid-speakers", type=int, default=20)
    ap.add_argument("--valid-utts", type=int, default=500)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
