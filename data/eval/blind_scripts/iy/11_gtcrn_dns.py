"""GTCRN-lite: a small grouped temporal conv + dual-path GRU denoiser for
streaming use. Trains on DNS clean/noise with random-SNR mixing, hybrid loss
(compressed complex MSE + SI-SNR), and reports PESQ/STOI on the synthetic test set.

    torchrun --nproc_per_node=4 11_gtcrn_dns.py --clean-list lists/clean.txt \
        --noise-list lists/noise.txt --test-dir /data/DNS/test/synthetic/no_reverb \
        --run-name gtcrn_lite_b32
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
import wandb
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR, N_FFT, HOP = 16000, 512, 256


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--clean-list", required=True)
    p.add_argument("--noise-list", required=True)
    p.add_argument("--test-dir", required=True)
    p.add_argument("--run-name", default="gtcrn")
    p.add_argument("--out", default="ckpt/gtcrn")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--snr-min", type=float, default=-5)
    p.add_argument("--snr-max", type=float, default=15)
    p.add_argument("--segment", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class DNSOnline(Dataset):
    def __init__(self, clean_list, noise_list, segment, snr_min, snr_max):
        self.clean = open(clean_list).read().split()
        self.noise = open(noise_list).read().split()
        self.n = int(segment * SR)
        self.snr_min, self.snr_max = snr_min, snr_max

    def __len__(self):
        return len(self.clean)

    def _get(self, path):
        info = sf.info(path)
        st = random.randint(0, max(info.frames - self.n, 0))
        x, _ = sf.read(path, start=st, frames=self.n, dtype="float32", always_2d=True)
        x = x[:, 0]
        return np.pad(x, (0, self.n - len(x))) if len(x) < self.n else x

    def __getitem__(self, i):
        s = self._get(self.clean[i])
        n = self._get(random.choice(self.noise))
        snr = random.uniform(self.snr_min, self.snr_max)
        n = n * np.sqrt(np.mean(s ** 2) / (np.mean(n ** 2) + 1e-9) / 10 ** (snr / 10))
        gain = 10 ** (random.uniform(-25, -10) / 20) / (np.abs(s + n).max() + 1e-9)
        return torch.from_numpy((s + n) * gain).float(), torch.from_numpy(s * gain).float()


class GTConv(nn.Module):
    """Grouped temporal convolution: point-wise -> causal dilated depth-wise -> point-wise."""

    def __init__(self, ch, dilation):
        super().__init__()
        self.pw1 = nn.Sequential(nn.Conv2d(ch // 2, ch, 1), nn.BatchNorm2d(ch), nn.PReLU(ch))
        self.dw = nn.Conv2d(ch, ch, (3, 3), dilation=(dilation, 1), padding=(0, 1), groups=ch)
        self.dw_norm = nn.Sequential(nn.BatchNorm2d(ch), nn.PReLU(ch))
        self.pw2 = nn.Sequential(nn.Conv2d(ch, ch // 2, 1), nn.BatchNorm2d(ch // 2))
        self.pad = 2 * dilation

    def forward(self, x):
        a, b = x.chunk(2, 1)
        h = self.pw1(b)
        h = self.dw_norm(self.dw(F.pad(h, (0, 0, self.pad, 0))))
        h = self.pw2(h)
        # channel shuffle after the split
        return torch.stack([a, h + b], 2).flatten(1, 2)


class DPGRNN(nn.Module):
    def __init__(self, ch, width, hidden):
        super().__init__()
        self.intra = nn.GRU(ch, hidden // 2, batch_first=True, bidirectional=True)
        self.intra_fc, self.intra_ln = nn.Linear(hidden, ch), nn.LayerNorm([width, ch])
        self.inter = nn.GRU(ch, hidden, batch_first=True)
        self.inter_fc, self.inter_ln = nn.Linear(hidden, ch), nn.LayerNorm([width, ch])

    def forward(self, x):
        # x: B, C, T, F
        x = x.permute(0, 2, 3, 1)                                   # B,T,F,C
        B, T, Fq, C = x.shape
        h = self.intra_fc(self.intra(x.reshape(B * T, Fq, C))[0]).reshape(B, T, Fq, C)
        x = x + self.intra_ln(h)
        h = self.inter(x.transpose(1, 2).reshape(B * Fq, T, C))[0]
        h = self.inter_fc(h).reshape(B, Fq, T, C).transpose(1, 2)
        x = x + self.inter_ln(h)
        return x.permute(0, 3, 1, 2)


class GTCRNLite(nn.Module):
    def __init__(self, ch=16, bands=129):
        super().__init__()
        self.erb = nn.Linear(N_FFT // 2 + 1, bands, bias=False)
        self.ierb = nn.Linear(bands, N_FFT // 2 + 1, bias=False)
        self.enc = nn.Sequential(
            nn.Conv2d(3, ch, (1, 5), (1, 2), (0, 2)), nn.BatchNorm2d(ch), nn.PReLU(ch),
            nn.Conv2d(ch, ch, (1, 5), (1, 2), (0, 2)), nn.BatchNorm2d(ch), nn.PReLU(ch))
        self.gt_enc = nn.Sequential(GTConv(ch, 1), GTConv(ch, 2), GTConv(ch, 5))
        self.rnn = nn.Sequential(DPGRNN(ch, 33, 32), DPGRNN(ch, 33, 32))
        self.gt_dec = nn.Sequential(GTConv(ch, 5), GTConv(ch, 2), GTConv(ch, 1))
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(ch, ch, (1, 5), (1, 2), (0, 2)), nn.BatchNorm2d(ch), nn.PReLU(ch),
            nn.ConvTranspose2d(ch, 2, (1, 5), (1, 2), (0, 2)))

    def forward(self, spec):
        # spec: complex B, F, T -> enhanced complex B, F, T
        feat = torch.stack([spec.abs(), spec.real, spec.imag], 1).transpose(2, 3)   # B,3,T,F
        x = self.enc(self.erb(feat))
        x = self.gt_dec(self.rnn(self.gt_enc(x)))
        m = self.ierb(self.dec(x))                                                  # B,2,T,F
        mask = torch.complex(m[:, 0], m[:, 1]).transpose(1, 2)
        return spec * mask


def hybrid_loss(est_spec, ref_spec, est_wav, ref_wav):
    em, rm = est_spec.abs().clamp_min(1e-12), ref_spec.abs().clamp_min(1e-12)
    ec, rc = est_spec / em.pow(0.7), ref_spec / rm.pow(0.7)
    ri = F.mse_loss(torch.view_as_real(ec), torch.view_as_real(rc))
    mag = F.mse_loss(em.pow(0.3), rm.pow(0.3))
    e, r = est_wav - est_wav.mean(-1, keepdim=True), ref_wav - ref_wav.mean(-1, keepdim=True)
    t = (e * r).sum(-1, keepdim=True) / (r.pow(2).sum(-1, keepdim=True) + 1e-8) * r
    sisnr = 10 * torch.log10(t.pow(2).sum(-1) / ((e - t).pow(2).sum(-1) + 1e-8) + 1e-8)
    return 30 * (ri + 0.7 * mag) - 0.01 * sisnr.mean()


@torch.no_grad()
def evaluate(net, files, test_dir, window, device):
    net.eval()
    acc = torch.zeros(3, device=device)
    for name in files:
        noisy, _ = sf.read(os.path.join(test_dir, "noisy", name), dtype="float32")
        clean, _ = sf.read(os.path.join(test_dir, "clean", name), dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        spec = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)
        est = torch.istft(net(spec), N_FFT, HOP, window=window, length=x.shape[-1])[0].cpu().numpy()
        acc += torch.tensor([pesq(SR, clean, est, "wb"), stoi(clean, est, SR), 1.0], device=device)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3407)
    random.seed(3407 + rank)

    wandb.init(project="speech-enhancement", name=args.run_name, config=vars(args))

    ds = DNSOnline(args.clean_list, args.noise_list, args.segment, args.snr_min, args.snr_max)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)
    test_files = sorted(os.listdir(os.path.join(args.test_dir, "noisy")))

    net = GTCRNLite()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
    window = torch.hann_window(N_FFT, device=device).pow(0.5)
    os.makedirs(args.out, exist_ok=True)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for noisy, clean in dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            n_spec = torch.stft(noisy, N_FFT, HOP, window=window, return_complex=True)
            c_spec = torch.stft(clean, N_FFT, HOP, window=window, return_complex=True)
            e_spec = model(n_spec)
            e_wav = torch.istft(e_spec, N_FFT, HOP, window=window, length=noisy.shape[-1])
            loss = hybrid_loss(e_spec, c_spec, e_wav, clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "lr": opt.param_groups[0]["lr"]}, step=step)
        sched.step()

        pesq_v, stoi_v = evaluate(net, test_files[rank::world], args.test_dir, window, device)
        if rank == 0:
            wandb.log({"val/pesq": pesq_v, "val/stoi": stoi_v, "epoch": epoch,
                       "epoch_time": time.time() - t0}, step=step)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if pesq_v > best:
                best = pesq_v
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
                wandb.run.summary["best_pesq"] = best
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
