"""Single-source Conv-TasNet for denoising. Trains on pre-synthesised DNS noisy/clean pairs cut into fixed
4 s chunks, validates every epoch, and at the end scores the best model on the DNS synthetic test set
(no_reverb) with per-file SI-SNRi / PESQ / STOI written to a CSV.

    torchrun --standalone --nproc_per_node=4 10_convtasnet_denoise_dns_test.py \
        --train_dir /data/dns_synth/train --valid_dir /data/dns_synth/valid \
        --test_dir /data/dns/test_set/synthetic/no_reverb --exp exp/tasnet_denoise
"""
import argparse
import csv
import glob
import os

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

SR = 16000


class ChunkDataset(Dataset):
    """All 4 s chunks (hop 2 s) of every noisy/clean pair in a folder."""

    def __init__(self, root, chunk=4.0, hop=2.0):
        self.noisy = sorted(glob.glob(os.path.join(root, "noisy", "*.wav")))
        self.chunk, self.hop = int(chunk * SR), int(hop * SR)
        self.index = []
        for i, f in enumerate(self.noisy):
            n = sf.info(f).frames
            for start in range(0, max(1, n - self.chunk + 1), self.hop):
                self.index.append((i, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, start = self.index[k]
        noisy_path = self.noisy[i]
        clean_path = noisy_path.replace(f"{os.sep}noisy{os.sep}", f"{os.sep}clean{os.sep}")
        x = sf.read(noisy_path, start=start, stop=start + self.chunk, dtype="float32")[0]
        y = sf.read(clean_path, start=start, stop=start + self.chunk, dtype="float32")[0]
        if len(x) < self.chunk:
            x, y = np.pad(x, (0, self.chunk - len(x))), np.pad(y, (0, self.chunk - len(y)))
        return torch.from_numpy(x), torch.from_numpy(y)


class cLN(nn.Module):
    """channel-wise layer norm (per frame)"""

    def __init__(self, ch):
        super().__init__()
        self.ln = nn.LayerNorm(ch)

    def forward(self, x):
        return self.ln(x.transpose(1, 2)).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, B, H, d, res=True):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(B, H, 1), nn.PReLU(), cLN(H),
                                  nn.Conv1d(H, H, 3, padding=d, dilation=d, groups=H), nn.PReLU(), cLN(H))
        self.res = nn.Conv1d(H, B, 1) if res else None
        self.skip = nn.Conv1d(H, B, 1)

    def forward(self, x):
        h = self.body(x)
        return (x + self.res(h)) if self.res is not None else x, self.skip(h)


class TasNetDenoiser(nn.Module):
    def __init__(self, N=256, L=32, B=128, H=256, X=8, R=3):
        super().__init__()
        self.enc = nn.Conv1d(1, N, L, L // 2, bias=False)
        self.bott = nn.Sequential(cLN(N), nn.Conv1d(N, B, 1))
        self.blocks = nn.ModuleList([Block(B, H, 2 ** (i % X), res=i < X * R - 1) for i in range(X * R)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(B, N, 1), nn.Sigmoid())
        self.dec = nn.ConvTranspose1d(N, 1, L, L // 2, bias=False)

    def forward(self, x):
        n = x.size(-1)
        w = F.relu(self.enc(x.unsqueeze(1)))
        h, skip = self.bott(w), 0
        for b in self.blocks:
            h, s = b(h)
            skip = skip + s
        y = self.dec(w * self.mask(skip)).squeeze(1)
        return F.pad(y, (0, max(0, n - y.size(-1))))[..., :n]


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    t = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(t.pow(2).sum(-1) / ((est - t).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def score_test_set(net, test_dir, out_csv, device, rank, world):
    net.eval()
    files = sorted(glob.glob(os.path.join(test_dir, "noisy", "*.wav")))
    rows = []
    for f in files[rank::world]:
        fid = int(f.rsplit("_fileid_", 1)[1].split(".")[0])
        noisy, _ = sf.read(f, dtype="float32")
        clean, _ = sf.read(os.path.join(test_dir, "clean", f"clean_fileid_{fid}.wav"), dtype="float32")
        x, y = torch.from_numpy(noisy).to(device), torch.from_numpy(clean).to(device)
        est = net(x[None])[0]
        sisnri = (si_snr(est, y) - si_snr(x, y)).item()
        e = est.cpu().numpy()
        rows.append([fid, sisnri, pesq(SR, clean, e, "wb"), stoi(clean, e, SR)])
    local = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if rank == 0:
        table = torch.cat(gathered).cpu().numpy()
        table = table[np.argsort(table[:, 0])]
        with open(out_csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["fileid", "si_snri", "pesq_wb", "stoi"])
            w.writerows([[int(r[0]), *r[1:]] for r in table])
        means = table[:, 1:].mean(0)
        print(f"TEST ({len(table)} files): SI-SNRi {means[0]:.2f} dB  PESQ {means[1]:.3f}  STOI {means[2]:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--valid_dir", required=True)
    ap.add_argument("--test_dir", required=True)
    ap.add_argument("--exp", default="exp/tasnet_denoise")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set, valid_set = ChunkDataset(args.train_dir), ChunkDataset(args.valid_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_set, args.batch_size, sampler=valid_sampler, num_workers=4)

    model = DDP(TasNetDenoiser().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-5)
    best_path = os.path.join(args.exp, "best.pt")
    best = -1e9
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for noisy, clean in train_dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = -si_snr(model(noisy), clean).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        sched.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for noisy, clean in valid_dl:
                noisy, clean = noisy.to(device), clean.to(device)
                acc[0] += si_snr(model.module(noisy), clean).sum()
                acc[1] += noisy.size(0)
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: valid SI-SNR {val:.2f} dB, lr {sched.get_last_lr()[0]:.2e}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, "last.pt"))
            if val > best:
                best = val
                torch.save(model.module.state_dict(), best_path)
        dist.barrier()

    net = TasNetDenoiser().to(device)
    net.load_state_dict(torch.load(best_path, map_location=device))
    score_test_set(net, args.test_dir, os.path.join(args.exp, "test_scores.csv"), device, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
