"""Magnitude/phase parallel enhancement network (MP-SENet style) on VoiceBank+DEMAND.

Stage 1 (first --mag-only-epochs epochs): only the magnitude decoder is trained,
the noisy phase is kept. Stage 2: the phase decoder is switched on and both are
trained jointly with the magnitude, complex and anti-wrapping phase losses.

    torchrun --nproc_per_node=4 07_mpsenet_vbd.py --data /data/vbd_16k --exp exp/mpsenet
    # continue a run
    torchrun --nproc_per_node=4 07_mpsenet_vbd.py --data /data/vbd_16k --exp exp/mpsenet --resume
"""
import argparse
import math
import os
import random
from glob import glob

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR, N_FFT, HOP, COMPRESS = 16000, 400, 100, 0.3


class VBDMix(Dataset):
    """VCTK clean speech + DEMAND noise mixed at SNR in {-5 .. 17.5} dB."""

    def __init__(self, clean_files, noise_files, seg=32000):
        self.clean_files, self.noise_files, self.seg = clean_files, noise_files, seg

    def __len__(self):
        return len(self.clean_files)

    def __getitem__(self, i):
        c, _ = sf.read(self.clean_files[i], dtype="float32")
        if len(c) < self.seg:
            c = torch.from_numpy(c).repeat(math.ceil(self.seg / len(c)))[: self.seg]
        else:
            o = random.randint(0, len(c) - self.seg)
            c = torch.from_numpy(c[o:o + self.seg])
        nf = random.choice(self.noise_files)
        frames = sf.info(nf).frames
        o = random.randint(0, frames - self.seg)
        n = torch.from_numpy(sf.read(nf, start=o, frames=self.seg, dtype="float32")[0])
        snr = random.choice([-5.0, 0.0, 5.0, 10.0, 15.0]) + random.uniform(0, 2.5)
        n = n * c.norm() / (n.norm() + 1e-8) * 10 ** (-snr / 20)
        x = c + n
        norm = math.sqrt(len(x) / (x.pow(2).sum().item() + 1e-8))
        return x * norm, c * norm


class TFBlock(nn.Module):
    def __init__(self, ch=64, heads=4):
        super().__init__()
        self.time = nn.TransformerEncoderLayer(ch, heads, 2 * ch, dropout=0.0, batch_first=True, norm_first=True)
        self.freq = nn.TransformerEncoderLayer(ch, heads, 2 * ch, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x):
        b, c, t, f = x.shape
        x = self.time(x.permute(0, 3, 2, 1).reshape(b * f, t, c)).reshape(b, f, t, c)
        x = self.freq(x.permute(0, 2, 1, 3).reshape(b * t, f, c)).reshape(b, t, f, c)
        return x.permute(0, 3, 1, 2)


class MPNet(nn.Module):
    def __init__(self, ch=64, blocks=4):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.encoder = nn.Sequential(
            nn.Conv2d(2, ch, 1), nn.InstanceNorm2d(ch, affine=True), nn.PReLU(ch),
            nn.Conv2d(ch, ch, (1, 3), (1, 2)), nn.InstanceNorm2d(ch, affine=True), nn.PReLU(ch))
        self.blocks = nn.Sequential(*[TFBlock(ch) for _ in range(blocks)])
        self.mag_dec = nn.Sequential(
            nn.ConvTranspose2d(ch, ch, (1, 3), (1, 2)), nn.InstanceNorm2d(ch, affine=True), nn.PReLU(ch),
            nn.Conv2d(ch, 1, 1))
        self.pha_dec = nn.Sequential(
            nn.ConvTranspose2d(ch, ch, (1, 3), (1, 2)), nn.InstanceNorm2d(ch, affine=True), nn.PReLU(ch))
        self.pha_re, self.pha_im = nn.Conv2d(ch, 1, 1), nn.Conv2d(ch, 1, 1)

    def analysis(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)
        return spec.abs().pow(COMPRESS), spec.angle()

    def synthesis(self, mag_c, pha, length):
        spec = torch.polar(mag_c.clamp_min(0).pow(1 / COMPRESS), pha)
        return torch.istft(spec, N_FFT, HOP, window=self.window, length=length)

    def forward(self, mag_c, pha, with_phase=True):
        # inputs (B, F, T) -> network works on (B, C, T, F)
        x = torch.stack([mag_c, pha], 1).transpose(2, 3)
        h = self.blocks(self.encoder(x))
        mask = 2.0 * torch.sigmoid(self.mag_dec(h))              # learnable-range magnitude mask
        est_mag = (mask.squeeze(1).transpose(1, 2)) * mag_c
        if not with_phase:
            return est_mag, pha
        p = self.pha_dec(h)
        est_pha = torch.atan2(self.pha_im(p), self.pha_re(p)).squeeze(1).transpose(1, 2)
        return est_mag, est_pha

    @torch.no_grad()
    def enhance(self, wav, chunk=SR * 6, fade=SR // 2):
        """Full-utterance inference, chunked with linear cross-fades for long files."""
        T = wav.shape[-1]
        if T <= chunk:
            m, p = self.analysis(wav[None])
            return self.synthesis(*self(m, p), T)[0]
        out = wav.new_zeros(T)
        wsum = wav.new_zeros(T)
        ramp = torch.linspace(0.0, 1.0, fade, device=wav.device)
        for s in range(0, T - fade, chunk - fade):
            seg = wav[s:s + chunk]
            m, p = self.analysis(seg[None])
            y = self.synthesis(*self(m, p), seg.shape[-1])[0]
            w = torch.ones_like(y)
            if s > 0:
                w[:fade] = ramp
            if s + chunk < T:
                w[-fade:] = ramp.flip(0)
            out[s:s + seg.shape[-1]] += y * w
            wsum[s:s + seg.shape[-1]] += w
        return out / wsum.clamp_min(1e-4)


def anti_wrap(x):
    return torch.abs(x - torch.round(x / (2 * math.pi)) * 2 * math.pi)


def phase_losses(pha_r, pha_g):
    ip = anti_wrap(pha_r - pha_g).mean()
    gd = anti_wrap(torch.diff(pha_r, dim=1) - torch.diff(pha_g, dim=1)).mean()
    iaf = anti_wrap(torch.diff(pha_r, dim=2) - torch.diff(pha_g, dim=2)).mean()
    return ip + gd + iaf


@torch.no_grad()
def evaluate(net, pairs, device):
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for noisy_f, clean_f in pairs:
        noisy, _ = sf.read(noisy_f, dtype="float32")
        clean, _ = sf.read(clean_f, dtype="float32")
        x = torch.from_numpy(noisy).to(device)
        g = math.sqrt(len(noisy) / (float((x ** 2).sum()) + 1e-8))
        est = (net.enhance(x * g) / g).cpu().numpy()
        acc += torch.tensor([pesq(SR, clean, est, "wb"), stoi(clean, est, SR), 1.0],
                            dtype=torch.float64, device=device)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", default="exp/mpsenet")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--mag-only-epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    clean = sorted(glob(f"{args.data}/clean_trainset_wav/*.wav"))
    noise = sorted(glob(f"{args.data}/demand/*/*.wav"))
    test = sorted(glob(f"{args.data}/noisy_testset_wav/*.wav"))
    test_pairs = [(t, t.replace("noisy_testset_wav", "clean_testset_wav")) for t in test]

    ds = VBDMix(clean, noise)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = MPNet().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.exp, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    # the phase decoder takes no part in stage 1
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        with_phase = epoch >= args.mag_only_epochs
        model.train()
        for step, (noisy, clean) in enumerate(dl):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            n_mag, n_pha = net.analysis(noisy)
            c_mag, c_pha = net.analysis(clean)
            e_mag, e_pha = model(n_mag, n_pha, with_phase=with_phase)
            loss = F.mse_loss(e_mag, c_mag)
            if with_phase:
                e_com = torch.stack([e_mag * torch.cos(e_pha), e_mag * torch.sin(e_pha)], -1)
                c_com = torch.stack([c_mag * torch.cos(c_pha), c_mag * torch.sin(c_pha)], -1)
                loss = 0.9 * loss + 0.3 * phase_losses(c_pha, e_pha) + 0.1 * F.mse_loss(e_com, c_com)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} phase={with_phase}", flush=True)
        sched.step()

        v_pesq, v_stoi = evaluate(net, test_pairs[rank::world], device)
        if rank == 0:
            print(f"epoch {epoch}: PESQ {v_pesq:.3f} STOI {v_stoi:.4f}", flush=True)
            best = max(best, v_pesq)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if v_pesq >= best:
                torch.save(net.state_dict(), os.path.join(args.exp, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
