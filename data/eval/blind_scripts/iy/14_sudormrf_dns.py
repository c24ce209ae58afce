"""SuDoRM-RF (U-ConvBlock) denoiser with a multi-resolution STFT + SI-SNR loss.

Training pairs are synthesised on the fly from clean speech and noise lists
(random SNR, random gain). Validation utterances can be minutes long, so they
are enhanced in overlapping 10 s segments.

    torchrun --nproc_per_node=8 14_sudormrf_dns.py --train-clean lists/clean.lst \
        --train-noise lists/noise.lst --valid-dir /data/valid --exp exp/sudormrf
"""
import argparse
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR = 16000


class RandomSNRMix(Dataset):
    def __init__(self, clean_lst, noise_lst, seconds=4.0, snr=(-5.0, 20.0), gain_db=(-30.0, -10.0)):
        self.clean = [l.strip() for l in open(clean_lst) if l.strip()]
        self.noise = [l.strip() for l in open(noise_lst) if l.strip()]
        self.n, self.snr, self.gain_db = int(seconds * SR), snr, gain_db

    def __len__(self):
        return len(self.clean)

    def _rand_seg(self, path):
        frames = sf.info(path).frames
        if frames < self.n:
            x, _ = sf.read(path, dtype="float32")
            return np.pad(x, (0, self.n - frames))
        st = random.randint(0, frames - self.n)
        return sf.read(path, start=st, frames=self.n, dtype="float32")[0]

    def __getitem__(self, i):
        s = self._rand_seg(self.clean[i])
        v = self._rand_seg(random.choice(self.noise))
        snr = random.uniform(*self.snr)
        v = v * (np.std(s) + 1e-8) / (np.std(v) + 1e-8) * 10 ** (-snr / 20)
        g = 10 ** (random.uniform(*self.gain_db) / 20) / (np.std(s + v) + 1e-8)
        return torch.from_numpy(((s + v) * g).astype(np.float32)), torch.from_numpy((s * g).astype(np.float32))


class UConvBlock(nn.Module):
    def __init__(self, out_ch=128, in_ch=512, depth=4):
        super().__init__()
        self.proj_in = nn.Sequential(nn.Conv1d(out_ch, in_ch, 1), nn.GroupNorm(1, in_ch), nn.PReLU())
        self.down = nn.ModuleList([nn.Sequential(
            nn.Conv1d(in_ch, in_ch, 5, stride=1 if i == 0 else 2, padding=2, groups=in_ch),
            nn.GroupNorm(1, in_ch)) for i in range(depth)])
        self.fuse = nn.Sequential(nn.GroupNorm(1, in_ch), nn.PReLU())
        self.proj_out = nn.Conv1d(in_ch, out_ch, 1)

    def forward(self, x):
        h = self.proj_in(x)
        outs = [self.down[0](h)]
        for layer in self.down[1:]:
            outs.append(layer(outs[-1]))
        y = outs.pop()
        while outs:
            skip = outs.pop()
            y = skip + F.interpolate(y, size=skip.shape[-1], mode="nearest")
        return x + self.proj_out(self.fuse(y))


class SuDORMRF(nn.Module):
    def __init__(self, enc_ch=512, bn_ch=128, blocks=16, kernel=21):
        super().__init__()
        self.kernel, self.stride = kernel, kernel // 2
        self.encoder = nn.Sequential(nn.Conv1d(1, enc_ch, kernel, self.stride, padding=kernel // 2), nn.ReLU())
        self.bottleneck = nn.Sequential(nn.GroupNorm(1, enc_ch), nn.Conv1d(enc_ch, bn_ch, 1))
        self.separator = nn.Sequential(*[UConvBlock(bn_ch, enc_ch) for _ in range(blocks)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(bn_ch, enc_ch, 1))
        self.decoder = nn.ConvTranspose1d(enc_ch, 1, kernel, self.stride, padding=kernel // 2,
                                          output_padding=self.stride - 1)

    def forward(self, wav):
        T = wav.shape[-1]
        mean, std = wav.mean(-1, keepdim=True), wav.std(-1, keepdim=True) + 1e-8
        x = ((wav - mean) / std).unsqueeze(1)
        w = self.encoder(x)
        m = torch.sigmoid(self.mask(self.separator(self.bottleneck(w))))
        y = self.decoder(w * m).squeeze(1)
        y = F.pad(y, (0, max(T - y.shape[-1], 0)))[..., :T]
        return y * std + mean


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self, fft=(2048, 1024, 512, 256), hop=(512, 256, 128, 64)):
        super().__init__()
        self.pairs = list(zip(fft, hop))
        for n, _ in self.pairs:
            self.register_buffer(f"win_{n}", torch.hann_window(n), persistent=False)

    def forward(self, est, ref):
        loss = est.new_zeros(())
        for n, h in self.pairs:
            win = getattr(self, f"win_{n}")
            E = torch.stft(est, n, h, window=win, return_complex=True).abs().clamp_min(1e-6)
            R = torch.stft(ref, n, h, window=win, return_complex=True).abs().clamp_min(1e-6)
            loss = loss + torch.linalg.norm(R - E) / torch.linalg.norm(R) + (E.log() - R.log()).abs().mean()
        return loss / len(self.pairs)


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(proj.pow(2).sum(-1) / ((est - proj).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def enhance_long(model, wav, segment=10 * SR, overlap=SR, device="cuda:0"):
    """Enhance a 1-D numpy waveform of any length; returns numpy."""
    x = torch.from_numpy(wav).to(device)
    T = x.numel()
    if T <= segment:
        return model(x[None])[0].cpu().numpy()
    hop = segment - overlap
    fade_in = torch.linspace(0, 1, overlap, device=device)
    out = torch.zeros(T, device=device)
    norm = torch.zeros(T, device=device)
    for st in range(0, T, hop):
        seg = x[st:st + segment]
        y = model(seg[None])[0]
        w = torch.ones_like(y)
        if st > 0:
            w[:overlap] = fade_in
        if st + segment < T:
            w[-overlap:] = fade_in.flip(0)
        out[st:st + y.numel()] += y * w
        norm[st:st + y.numel()] += w
        if st + segment >= T:
            break
    return (out / norm.clamp_min(1e-6)).cpu().numpy()


@torch.no_grad()
def validate(net, names, valid_dir, device):
    net.eval()
    acc = torch.zeros(4, device=device)
    for name in names:
        noisy, _ = sf.read(os.path.join(valid_dir, "noisy", name), dtype="float32")
        clean, _ = sf.read(os.path.join(valid_dir, "clean", name), dtype="float32")
        est = enhance_long(net, noisy)
        acc[0] += si_snr(torch.from_numpy(est), torch.from_numpy(clean)).item()
        acc[1] += pesq(SR, clean, est, "wb")
        acc[2] += stoi(clean, est, SR)
        acc[3] += 1
    dist.all_reduce(acc)
    net.train()
    return {k: (acc[i] / acc[3]).item() for i, k in enumerate(("si_snr", "pesq", "stoi"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-clean", required=True)
    ap.add_argument("--train-noise", required=True)
    ap.add_argument("--valid-dir", required=True)
    ap.add_argument("--exp", default="exp/sudormrf")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)
    random.seed(11 + rank)

    ds = RandomSNRMix(args.train_clean, args.train_noise)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    valid_names = sorted(os.listdir(os.path.join(args.valid_dir, "noisy")))[rank::world]

    net = SuDORMRF().to(device)
    model = DDP(net, device_ids=[local_rank])
    mrstft = MultiResolutionSTFTLoss().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[40, 80], gamma=0.3)
    os.makedirs(args.exp, exist_ok=True)

    best = -1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (noisy, clean) in enumerate(dl):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            est = model(noisy)
            loss = mrstft(est, clean) - 0.1 * si_snr(est, clean).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(dl)} loss {loss.item():.4f}", flush=True)
        sched.step()

        res = validate(net, valid_names, args.valid_dir, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) valid {res}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.exp, "last.pt"))
            if res["si_snr"] > best:
                best = res["si_snr"]
                torch.save(net.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
