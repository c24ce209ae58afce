"""Spectrogram U-Net (magnitude mask) for VoiceBank-DEMAND with on-the-fly
remixing: every epoch the clean training utterances are re-mixed with DEMAND
noise at random SNRs. Model selection uses wide-band PESQ on the official
test set (824 utterances, full length).

    torchrun --nproc_per_node=4 20_unet_vbd.py --vbd-root /data/VoiceBank-DEMAND-16k --log-dir runs/unet
"""
import argparse
import glob
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
from torch.utils.tensorboard import SummaryWriter

SR, N_FFT, HOP = 16000, 512, 128


class RemixTrain(Dataset):
    def __init__(self, clean_files, noise_files, seg=SR * 2, snr_range=(-5, 20)):
        self.clean_files = clean_files
        self.noise = [sf.read(f, dtype="float32")[0] for f in noise_files]
        self.seg, self.snr_range = seg, snr_range

    def __len__(self):
        return len(self.clean_files)

    def __getitem__(self, i):
        c, _ = sf.read(self.clean_files[i], dtype="float32")
        if len(c) < self.seg:
            c = np.pad(c, (0, self.seg - len(c)))
        o = random.randint(0, len(c) - self.seg)
        c = c[o:o + self.seg]
        n = random.choice(self.noise)
        o = random.randint(0, len(n) - self.seg)
        n = n[o:o + self.seg]
        snr = random.uniform(*self.snr_range)
        n = n * np.sqrt(np.mean(c ** 2) / (np.mean(n ** 2) + 1e-9)) / 10 ** (snr / 20)
        return torch.from_numpy((c + n).astype(np.float32)), torch.from_numpy(c)


class TestPairs(Dataset):
    def __init__(self, noisy_files):
        self.noisy_files = noisy_files

    def __len__(self):
        return len(self.noisy_files)

    def __getitem__(self, i):
        noisy, _ = sf.read(self.noisy_files[i], dtype="float32")
        clean, _ = sf.read(self.noisy_files[i].replace("noisy_testset", "clean_testset"), dtype="float32")
        return torch.from_numpy(noisy), torch.from_numpy(clean)


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU())


class SpecUNet(nn.Module):
    def __init__(self, base=32, depth=4):
        super().__init__()
        chs = [base * 2 ** i for i in range(depth + 1)]
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.inc = block(1, chs[0])
        self.downs = nn.ModuleList([block(chs[i], chs[i + 1]) for i in range(depth)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, 2) for i in reversed(range(depth))])
        self.up_blocks = nn.ModuleList([block(2 * chs[i], chs[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(chs[0], 1, 1)
        self.mult = 2 ** depth

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)
        mag = spec.abs()
        Fq, T = mag.shape[-2:]
        x = torch.log1p(mag)[:, None]
        x = F.pad(x, (0, (-T) % self.mult, 0, (-Fq) % self.mult))
        x = self.inc(x)
        skips = [x]
        for d in self.downs:
            x = d(F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, blk in zip(self.ups, self.up_blocks):
            x = blk(torch.cat([up(x), skips.pop()], 1))
        mask = torch.sigmoid(self.head(x))[:, 0, :Fq, :T]
        return torch.istft(spec * mask, N_FFT, HOP, window=self.window, length=wav.shape[-1])


def stft_l1(est, ref, window):
    E = torch.stft(est, N_FFT, HOP, window=window, return_complex=True)
    R = torch.stft(ref, N_FFT, HOP, window=window, return_complex=True)
    return F.l1_loss(E.abs(), R.abs()) + F.l1_loss(torch.view_as_real(E), torch.view_as_real(R))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    pesq_scores, stoi_scores, losses = [], [], []
    for noisy, clean in loader:
        noisy, clean = noisy.to(device), clean.to(device)
        est = net(noisy)
        losses.append(stft_l1(est, clean, net.window).item())
        e, c = est[0].cpu().numpy(), clean[0].cpu().numpy()
        pesq_scores.append(pesq(SR, c, e, "wb"))
        stoi_scores.append(stoi(c, e, SR))
    net.train()
    return float(np.mean(losses)), float(np.mean(pesq_scores)), float(np.mean(stoi_scores))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vbd-root", required=True)
    ap.add_argument("--log-dir", default="runs/unet")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(31)
    random.seed(31 + rank)

    clean = sorted(glob.glob(os.path.join(args.vbd_root, "clean_trainset_28spk_wav", "*.wav")))
    noise = sorted(glob.glob(os.path.join(args.vbd_root, "demand", "*", "ch01.wav")))
    test = sorted(glob.glob(os.path.join(args.vbd_root, "noisy_testset_wav", "*.wav")))

    train_set = RemixTrain(clean, noise)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_set = TestPairs(test)
    test_loader = DataLoader(test_set, batch_size=1, num_workers=2,
                             sampler=DistributedSampler(test_set, shuffle=False))

    net = SpecUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    writer = SummaryWriter(args.log_dir) if rank == 0 else None

    best_pesq, gstep = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for noisy, clean in train_loader:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = stft_l1(model(noisy), clean, net.window)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            gstep += 1
            if writer and gstep % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
        sched.step()

        val_loss, val_pesq, val_stoi = evaluate(net, test_loader, device)
        if rank == 0:
            writer.add_scalar("valid/loss", val_loss, epoch)
            writer.add_scalar("valid/pesq", val_pesq, epoch)
            writer.add_scalar("valid/stoi", val_stoi, epoch)
            print(f"epoch {epoch}: loss {val_loss:.4f} PESQ {val_pesq:.3f} STOI {val_stoi:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.log_dir, "last.pt"))
            if val_pesq > best_pesq:
                best_pesq = val_pesq
                torch.save(net.state_dict(), os.path.join(args.log_dir, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
