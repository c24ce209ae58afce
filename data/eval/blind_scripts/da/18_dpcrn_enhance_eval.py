"""DPCRN (dual-path convolution recurrent network) for 16 kHz speech enhancement.
Training on fixed 4 s segments of VoiceBank+DEMAND-style pairs; PESQ / STOI / SI-SNRi on the full test set.

    torchrun --standalone --nproc_per_node=4 18_dpcrn_enhance_eval.py --train_dir /data/vbd/train --test_dir /data/vbd/test
"""
import argparse
import glob
import logging
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_FFT, HOP = 400, 200
SR = 16000


class PairFolder(Dataset):
    def __init__(self, root, segment=None):
        self.noisy = sorted(glob.glob(os.path.join(root, "noisy", "*.wav")))
        self.clean_root = os.path.join(root, "clean")
        self.seg = int(segment * SR) if segment else None

    def __len__(self):
        return len(self.noisy)

    def __getitem__(self, i):
        x = sf.read(self.noisy[i], dtype="float32")[0]
        y = sf.read(os.path.join(self.clean_root, os.path.basename(self.noisy[i])), dtype="float32")[0]
        if self.seg is not None:
            if len(x) < self.seg:
                x, y = np.pad(x, (0, self.seg - len(x))), np.pad(y, (0, self.seg - len(y)))
            else:
                o = random.randint(0, len(x) - self.seg)
                x, y = x[o:o + self.seg], y[o:o + self.seg]
        return torch.from_numpy(x), torch.from_numpy(y)


class DPRNNLayer(nn.Module):
    def __init__(self, ch=128, n_freq=51):
        super().__init__()
        self.intra = nn.LSTM(ch, ch // 2, batch_first=True, bidirectional=True)
        self.intra_fc = nn.Linear(ch, ch)
        self.intra_ln = nn.LayerNorm([n_freq, ch])
        self.inter = nn.LSTM(ch, ch, batch_first=True)
        self.inter_fc = nn.Linear(ch, ch)
        self.inter_ln = nn.LayerNorm([n_freq, ch])

    def forward(self, x):  # B, C, T, F
        B, C, T, Fq = x.shape
        y = x.permute(0, 2, 3, 1)  # B, T, F, C
        intra = self.intra_fc(self.intra(y.reshape(B * T, Fq, C))[0]).reshape(B, T, Fq, C)
        y = y + self.intra_ln(intra)
        inter_in = y.permute(0, 2, 1, 3).reshape(B * Fq, T, C)
        inter = self.inter_fc(self.inter(inter_in)[0]).reshape(B, Fq, T, C).permute(0, 2, 1, 3)
        y = y + self.inter_ln(inter)
        return y.permute(0, 3, 1, 2)


def enc_layer(cin, cout, kf, sf_, pf):
    return nn.Sequential(nn.ConstantPad2d((0, 0, 1, 0), 0.0), nn.Conv2d(cin, cout, (2, kf), (1, sf_), (0, pf)),
                         nn.GroupNorm(1, cout), nn.PReLU(cout))


class DPCRN(nn.Module):
    def __init__(self):
        super().__init__()
        spec = [(2, 32, 5, 2, 2), (32, 32, 3, 2, 1), (32, 32, 3, 1, 1), (32, 64, 3, 1, 1), (64, 128, 3, 1, 1)]
        self.encoder = nn.ModuleList([enc_layer(*s) for s in spec])
        self.dprnn = nn.Sequential(DPRNNLayer(), DPRNNLayer())
        self.decoder = nn.ModuleList()
        for i, (cin, cout, kf, sf_, pf) in reversed(list(enumerate(spec))):
            out_ch = cin
            layers = [nn.ConvTranspose2d(2 * cout, out_ch, (2, kf), (1, sf_), (0, pf))]
            if i > 0:
                layers += [nn.GroupNorm(1, out_ch), nn.PReLU(out_ch)]
            self.decoder.append(nn.Sequential(*layers))
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)  # B, F, T
        x = torch.stack([spec.real, spec.imag], 1).transpose(2, 3)  # B, 2, T, F
        skips = []
        for layer in self.encoder:
            x = layer(x)
            skips.append(x)
        x = self.dprnn(x)
        for layer in self.decoder:
            x = layer(torch.cat([x, skips.pop()], 1))[:, :, :-1]
        mask = torch.complex(x[:, 0], x[:, 1]).transpose(1, 2)  # B, F, T
        return torch.istft(spec * mask, N_FFT, HOP, window=self.window, length=wav.size(-1))


def si_snr(e, r, eps=1e-8):
    e, r = e - e.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    s = (e * r).sum(-1, keepdim=True) * r / (r.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((e - s).pow(2).sum(-1) + eps) + eps)


def spec_loss(est, ref, window):
    E = torch.stft(est, N_FFT, HOP, window=window, return_complex=True)
    R = torch.stft(ref, N_FFT, HOP, window=window, return_complex=True)
    Ec, Rc = E.abs().clamp_min(1e-8) ** 0.3, R.abs().clamp_min(1e-8) ** 0.3
    cplx = (Ec * torch.exp(1j * E.angle()) - Rc * torch.exp(1j * R.angle())).abs().pow(2).mean()
    return F.mse_loss(Ec, Rc) + cplx


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    pesq_scores, stoi_scores, sisnri_scores = [], [], []
    for noisy, clean in loader:
        noisy, clean = noisy.to(device), clean.to(device)
        enh = net(noisy)
        sisnri_scores.append((si_snr(enh, clean) - si_snr(noisy, clean)).item())
        e, c = enh[0].cpu().numpy(), clean[0].cpu().numpy()
        pesq_scores.append(pesq(SR, c, e, "wb"))
        stoi_scores.append(stoi(c, e, SR))
    net.train()
    return float(np.mean(pesq_scores)), float(np.mean(stoi_scores)), float(np.mean(sisnri_scores))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--test_dir", required=True)
    ap.add_argument("--exp", default="exp/dpcrn")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("dpcrn")

    train_set = PairFolder(args.train_dir, segment=4.0)
    test_set = PairFolder(args.test_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_set, batch_size=1, sampler=test_sampler, num_workers=2)

    model = DDP(DPCRN().to(device), device_ids=[local_rank])
    window = torch.hann_window(N_FFT, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-5)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    best_pesq = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for noisy, clean in train_dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            est = model(noisy)
            loss = -0.01 * si_snr(est, clean).mean() + spec_loss(est, clean, window)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)

        pesq_wb, stoi_v, sisnri = evaluate(model.module, test_dl, device)
        if rank == 0:
            log.info("epoch %d | train %.4f | test PESQ %.3f STOI %.4f SI-SNRi %.2f", epoch,
                     (total[0] / total[1]).item(), pesq_wb, stoi_v, sisnri)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.exp, "last.pt"))
            if pesq_wb > best_pesq:
                best_pesq = pesq_wb
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
