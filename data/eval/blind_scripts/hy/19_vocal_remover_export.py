"""Vocal remover (instrumental extraction): conv encoder / BLSTM bottleneck / conv decoder
over the magnitude spectrogram, trained with DDP. After training the best weights are
reloaded for the final test-set evaluation and exported for the inference app.

    torchrun --nproc_per_node=4 19_vocal_remover_export.py --data /data/vr_dataset --out runs/vr_lstm
"""
import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR, N_FFT, HOP = 44100, 2048, 1024


class ConvGN(nn.Sequential):
    def __init__(self, cin, cout, stride=1):
        super().__init__(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.GroupNorm(4, cout), nn.SiLU())


class VocalRemover(nn.Module):
    def __init__(self, base=32, lstm_hidden=256):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.enc1 = nn.Sequential(ConvGN(2, base), ConvGN(base, base))
        self.enc2 = nn.Sequential(ConvGN(base, 2 * base, (2, 1)), ConvGN(2 * base, 2 * base))
        self.enc3 = nn.Sequential(ConvGN(2 * base, 4 * base, (2, 1)), ConvGN(4 * base, 4 * base))
        self.enc4 = nn.Sequential(ConvGN(4 * base, 8 * base, (2, 1)), ConvGN(8 * base, 8 * base))
        self.squeeze = nn.Conv2d(8 * base, 1, 1)
        self.lstm = nn.LSTM(N_FFT // 16, lstm_hidden, batch_first=True, bidirectional=True)
        self.expand = nn.Linear(2 * lstm_hidden, N_FFT // 16)
        self.dec4 = ConvGN(8 * base + 1, 4 * base)
        self.dec3 = ConvGN(8 * base, 2 * base)
        self.dec2 = ConvGN(4 * base, base)
        self.dec1 = ConvGN(2 * base, base)
        self.head = nn.Conv2d(base, 2, 1)

    def spec(self, wav):
        b, c, t = wav.shape
        Z = torch.stft(wav.reshape(b * c, t), N_FFT, HOP, window=self.window, return_complex=True)
        return Z.reshape(b, c, *Z.shape[-2:])

    def forward(self, wav):
        Z = self.spec(wav)
        mag = Z.abs()[:, :, :-1]  # drop Nyquist bin -> 1024 bins
        x = torch.log1p(mag)
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        e3 = self.enc3(e2)
        e4 = self.enc4(e3)
        s = self.squeeze(e4)[:, 0].transpose(1, 2)  # B T F/8
        s = self.expand(self.lstm(s)[0]).transpose(1, 2)[:, None]
        d = self.dec4(torch.cat([e4, s], 1))
        d = self.dec3(torch.cat([F.interpolate(d, size=e3.shape[-2:]), e3], 1))
        d = self.dec2(torch.cat([F.interpolate(d, size=e2.shape[-2:]), e2], 1))
        d = self.dec1(torch.cat([F.interpolate(d, size=e1.shape[-2:]), e1], 1))
        mask = torch.sigmoid(self.head(d))
        mask = F.pad(mask, (0, 0, 0, 1), value=1.0)
        inst = (Z * mask).reshape(-1, *Z.shape[-2:])
        return torch.istft(inst, N_FFT, HOP, window=self.window, length=wav.shape[-1]).reshape(wav.shape)


class PairRemix(Dataset):
    """<root>/<song>/{instrumental,vocals}.wav ; the vocal of another song is mixed in with p=mix_prob."""

    def __init__(self, songs, seconds, items, mix_prob=0.5):
        self.songs, self.items, self.mix_prob = songs, items, mix_prob
        self.n = int(seconds * SR)
        self.frames = [sf.info(str(s / "instrumental.wav")).frames for s in songs]

    def __len__(self):
        return self.items

    def read(self, k, stem, off):
        x, _ = sf.read(str(self.songs[k] / f"{stem}.wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
        return np.pad(x, ((0, self.n - len(x)), (0, 0))).T

    def __getitem__(self, i):
        k = random.randrange(len(self.songs))
        off = random.randint(0, max(0, self.frames[k] - self.n))
        inst = self.read(k, "instrumental", off)
        kv, offv = k, off
        if random.random() < self.mix_prob:
            kv = random.randrange(len(self.songs))
            offv = random.randint(0, max(0, self.frames[kv] - self.n))
        voc = self.read(kv, "vocals", offv) * random.uniform(0.5, 1.5)
        return torch.from_numpy((inst + voc).astype(np.float32)), torch.from_numpy(inst.astype(np.float32))


@torch.no_grad()
def song_sdr(net, song, device, chunk=SR * 16, ctx=SR * 2):
    inst, _ = sf.read(str(song / "instrumental.wav"), dtype="float32", always_2d=True)
    voc, _ = sf.read(str(song / "vocals.wav"), dtype="float32", always_2d=True)
    n = min(len(inst), len(voc))
    ref = torch.from_numpy(inst[:n].T.copy())
    mix = ref + torch.from_numpy(voc[:n].T.copy())
    est = torch.zeros_like(mix)
    for s in range(0, n, chunk):
        a, b = max(0, s - ctx), min(n, s + chunk + ctx)
        y = net(mix[None, :, a:b].to(device))[0].cpu()
        e = min(n, s + chunk)
        est[:, s:e] = y[:, s - a:e - a]
    return 10 * torch.log10(ref.pow(2).sum() / (ref - est).pow(2).sum().clamp_min(1e-9)).item()


def eval_songs(net, songs, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    net.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for song in songs[rank::world]:
        acc[0] += song_sdr(net, song, device)
        acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--items", type=int, default=12000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    splits = {name: sorted(p for p in (args.data / name).iterdir() if p.is_dir()) for name in ("train", "valid", "test")}
    ds = PairRemix(splits["train"], args.seconds, args.items)
    sampler = DistributedSampler(ds)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, worker_init_fn=lambda w: random.seed(torch.initial_seed() + 1009 * rank))

    net = VocalRemover().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)
    best, best_path = -float("inf"), args.out / "best.pth"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for mix, inst in dl:
            mix, inst = mix.to(device, non_blocking=True), inst.to(device, non_blocking=True)
            est = model(mix)
            loss = F.l1_loss(net.spec(est).abs(), net.spec(inst).abs()) + F.l1_loss(est, inst)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        valid_sdr = eval_songs(net, splits["valid"], device)
        sched.step(valid_sdr)
        if rank == 0:
            print(f"epoch {epoch} valid inst SDR {valid_sdr:.2f} dB lr {opt.param_groups[0]['lr']:.1e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if valid_sdr > best:
                best = valid_sdr
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # final evaluation with the best weights, then export for the inference app
    net.load_state_dict(torch.load(best_path, map_location=device))
    test_sdr = eval_songs(net, splits["test"], device)
    if rank == 0:
        print(f"test inst SDR {test_sdr:.2f} dB (best valid {best:.2f})", flush=True)
        net.cpu().eval()
        example = torch.zeros(1, 2, SR * 4)
        torch.jit.trace(net, example).save(str(args.out / "vocal_remover.ts"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
