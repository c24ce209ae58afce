"""DPCRN: dual-path convolution recurrent network for speech enhancement.

    torchrun --nproc_per_node=8 18_dpcrn_dns.py \
        --clean-dir /data/dns/clean --noise-dir /data/dns/noise \
        --valid-dir /data/dns/valid --exp exp/dpcrn --resume
"""
import argparse
import glob
import logging
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR, N_FFT, HOP, WIN = 16000, 400, 200, 400
logger = logging.getLogger("dpcrn")


class DNSMixer(Dataset):
    def __init__(self, clean_files, noise_files, seconds=5.0, snr_range=(-5.0, 20.0)):
        self.clean_files, self.noise_files = clean_files, noise_files
        self.n = int(seconds * SR)
        self.snr_range = snr_range

    def __len__(self):
        return len(self.clean_files)

    def _read(self, f):
        total = sf.info(f).frames
        start = random.randint(0, max(0, total - self.n))
        x, _ = sf.read(f, start=start, frames=self.n, dtype="float32", always_2d=True, fill_value=0.0)
        return x[:, 0]

    def __getitem__(self, idx):
        clean = self._read(self.clean_files[idx])
        noise = self._read(random.choice(self.noise_files))
        snr = random.uniform(*self.snr_range)
        alpha = np.sqrt((clean ** 2).sum() / ((noise ** 2).sum() * 10 ** (snr / 10) + 1e-10))
        noisy = clean + alpha * noise
        m = max(np.abs(noisy).max(), 1e-4)
        gain = min(1.0, 0.95 / m)
        return torch.from_numpy((noisy * gain).astype(np.float32)), torch.from_numpy((clean * gain).astype(np.float32))


class DPRNN(nn.Module):
    def __init__(self, ch, width, hidden=128):
        super().__init__()
        self.intra = nn.LSTM(ch, hidden // 2, batch_first=True, bidirectional=True)
        self.intra_fc = nn.Linear(hidden, ch)
        self.intra_ln = nn.LayerNorm([width, ch])
        self.inter = nn.LSTM(ch, hidden, batch_first=True)
        self.inter_fc = nn.Linear(hidden, ch)
        self.inter_ln = nn.LayerNorm([width, ch])

    def forward(self, x):
        b, c, t, f = x.shape
        x = x.permute(0, 2, 3, 1)                                   # b,t,f,c
        intra = self.intra_fc(self.intra(x.reshape(b * t, f, c))[0]).reshape(b, t, f, c)
        x = x + self.intra_ln(intra)
        inter = self.inter(x.permute(0, 2, 1, 3).reshape(b * f, t, c))[0]
        inter = self.inter_fc(inter).reshape(b, f, t, c).permute(0, 2, 1, 3)
        x = x + self.inter_ln(inter)
        return x.permute(0, 3, 1, 2)


class DPCRN(nn.Module):
    def __init__(self):
        super().__init__()
        # (cin, cout, kernel_f, stride_f)
        enc_cfg = [(2, 32, 5, 2), (32, 32, 3, 2), (32, 32, 3, 1), (32, 64, 3, 1), (64, 128, 3, 1)]
        self.enc = nn.ModuleList([
            nn.Sequential(nn.Conv2d(ci, co, (2, k), (1, s), (0, k // 2)), nn.BatchNorm2d(co), nn.PReLU(co))
            for ci, co, k, s in enc_cfg])
        self.dprnn = nn.Sequential(DPRNN(128, 51), DPRNN(128, 51))
        dec_cfg = [(256, 64, 3, 1), (128, 32, 3, 1), (64, 32, 3, 1), (64, 32, 3, 2), (64, 2, 5, 2)]
        self.dec = nn.ModuleList()
        for i, (ci, co, k, s) in enumerate(dec_cfg):
            conv = nn.ConvTranspose2d(ci, co, (2, k), (1, s), (1, k // 2), output_padding=(0, s - 1))
            last = i == len(dec_cfg) - 1
            self.dec.append(conv if last else nn.Sequential(conv, nn.BatchNorm2d(co), nn.PReLU(co)))

    def forward(self, spec):
        x = torch.stack([spec.real, spec.imag], 1).transpose(2, 3)  # B,2,T,F
        T, Fq = x.shape[2], x.shape[3]
        skips = []
        for layer in self.enc:
            x = layer(F.pad(x, (0, 0, 1, 0)))
            skips.append(x)
        x = self.dprnn(x)
        for layer in self.dec:
            skip = skips.pop()
            x = layer(torch.cat([x[..., :skip.shape[-1]], skip], 1))[:, :, :T]
        x = F.pad(x, (0, Fq - x.shape[-1]))[..., :Fq]
        mr, mi = x[:, 0].transpose(1, 2), x[:, 1].transpose(1, 2)
        return torch.complex(spec.real * mr - spec.imag * mi, spec.real * mi + spec.imag * mr)


def compressed_loss(est, ref, p=0.3):
    em, rm = est.abs() + 1e-8, ref.abs() + 1e-8
    e_c, r_c = est / em * em.pow(p), ref / rm * rm.pow(p)
    return F.mse_loss(em.pow(p), rm.pow(p)) + F.mse_loss(torch.view_as_real(e_c), torch.view_as_real(r_c))


def save_checkpoint(path, net, optimizer, epoch, best_pesq):
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "best_pesq": best_pesq}, path)


@torch.no_grad()
def evaluate(net, files, valid_dir, window, device):
    net.eval()
    acc = torch.zeros(3, device=device)
    for name in files:
        noisy, _ = sf.read(os.path.join(valid_dir, "noisy", name), dtype="float32")
        clean, _ = sf.read(os.path.join(valid_dir, "clean", name), dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        spec = torch.stft(x, N_FFT, HOP, WIN, window, return_complex=True)
        est = torch.istft(net(spec), N_FFT, HOP, WIN, window, length=x.shape[-1])[0].cpu().numpy()
        acc[0] += pesq(SR, clean, est, "wb")
        acc[1] += stoi(clean, est, SR)
        acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean-dir", required=True)
    ap.add_argument("--noise-dir", required=True)
    ap.add_argument("--valid-dir", required=True)
    ap.add_argument("--exp", default="exp/dpcrn")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(name)s %(message)s")
    random.seed(rank)
    torch.manual_seed(0)

    clean_files = sorted(glob.glob(os.path.join(args.clean_dir, "*.wav")))
    noise_files = sorted(glob.glob(os.path.join(args.noise_dir, "*.wav")))
    valid_files = sorted(os.listdir(os.path.join(args.valid_dir, "noisy")))[rank::world]
    ds = DNSMixer(clean_files, noise_files)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DPCRN()).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    window = torch.hann_window(WIN, device=device).sqrt()
    os.makedirs(args.exp, exist_ok=True)
    last_path, best_path = os.path.join(args.exp, "last.pt"), os.path.join(args.exp, "best.pt")

    start_epoch, best_pesq = 0, 0.0
    if args.resume and os.path.isfile(last_path):
        ck = torch.load(last_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, best_pesq = ck["epoch"] + 1, ck["best_pesq"]
        logger.info("resumed at epoch %d (best PESQ %.3f)", start_epoch, best_pesq)
    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, losses = time.time(), []
        for noisy, clean in dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            n_spec = torch.stft(noisy, N_FFT, HOP, WIN, window, return_complex=True)
            c_spec = torch.stft(clean, N_FFT, HOP, WIN, window, return_complex=True)
            loss = compressed_loss(model(n_spec), c_spec)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            losses.append(loss.item())
        logger.info("epoch %d train loss %.4f (%.0fs)", epoch, np.mean(losses), time.time() - t0)

        v_pesq, v_stoi = evaluate(net, valid_files, args.valid_dir, window, device)
        logger.info("epoch %d valid PESQ %.3f STOI %.4f", epoch, v_pesq, v_stoi)
        if v_pesq > best_pesq:
            best_pesq = v_pesq
            save_checkpoint(best_path, net, optimizer, epoch, best_pesq)
        save_checkpoint(last_path, net, optimizer, epoch, best_pesq)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
