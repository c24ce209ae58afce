"""uPIT-BLSTM: T-F masking separation (2 speakers, wsj0-2mix 8k) with utterance-level PIT.
STFT / iSTFT run on the GPU; the loss is PIT SI-SNR on the resynthesised waveforms.

    torchrun --standalone --nproc_per_node=4 17_upit_blstm_stft.py --data /data/wsj0-2mix/wav8k/min --exp exp/upit
"""
import argparse
import itertools
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser(description="uPIT BLSTM training")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--exp", type=str, default="exp/upit")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--n_fft", type=int, default=256)
    parser.add_argument("--hop", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--segment", type=float, default=4.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=4)
    return parser


class Wsj2Mix(Dataset):
    def __init__(self, split_dir, segment=None, sr=8000):
        self.split_dir = split_dir
        self.files = sorted(os.listdir(os.path.join(split_dir, "mix")))
        self.seg = int(segment * sr) if segment else None

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        mix = sf.read(os.path.join(self.split_dir, "mix", f), dtype="float32")[0]
        s1 = sf.read(os.path.join(self.split_dir, "s1", f), dtype="float32")[0]
        s2 = sf.read(os.path.join(self.split_dir, "s2", f), dtype="float32")[0]
        if self.seg:
            if len(mix) >= self.seg:
                o = random.randint(0, len(mix) - self.seg)
                mix, s1, s2 = mix[o:o + self.seg], s1[o:o + self.seg], s2[o:o + self.seg]
            else:
                pad = self.seg - len(mix)
                mix, s1, s2 = np.pad(mix, (0, pad)), np.pad(s1, (0, pad)), np.pad(s2, (0, pad))
        return torch.from_numpy(mix), torch.from_numpy(np.stack([s1, s2]))


class UPITBLSTM(nn.Module):
    def __init__(self, n_fft=256, hop=64, hidden=896, layers=3, n_src=2):
        super().__init__()
        self.n_fft, self.hop, self.n_src = n_fft, hop, n_src
        n_freq = n_fft // 2 + 1
        self.register_buffer("window", torch.sqrt(torch.hann_window(n_fft)), persistent=False)
        self.blstm = nn.LSTM(n_freq, hidden, num_layers=layers, batch_first=True, bidirectional=True, dropout=0.3)
        self.masks = nn.Linear(2 * hidden, n_src * n_freq)

    def forward(self, mix):
        spec = torch.stft(mix, self.n_fft, self.hop, window=self.window, return_complex=True)  # B,F,T
        feat = torch.log1p(spec.abs()).transpose(1, 2)
        h, _ = self.blstm(feat)
        m = torch.sigmoid(self.masks(h)).view(mix.size(0), -1, self.n_src, spec.size(1)).permute(0, 2, 3, 1)
        est_spec = m * spec.unsqueeze(1)
        est = torch.istft(est_spec.flatten(0, 1), self.n_fft, self.hop, window=self.window, length=mix.size(-1))
        return est.view(mix.size(0), self.n_src, -1)


def si_snr(e, r, eps=1e-8):
    e, r = e - e.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    s = (e * r).sum(-1, keepdim=True) * r / (r.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((e - s).pow(2).sum(-1) + eps) + eps)


def upit_si_snr(est, ref):
    pw = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    a = torch.arange(est.size(1), device=est.device)
    return torch.stack([pw[:, a, list(p)].mean(-1) for p in itertools.permutations(range(est.size(1)))], 1).amax(1)


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(2024)

    train_set = Wsj2Mix(os.path.join(args.data, "tr"), segment=args.segment)
    cv_set = Wsj2Mix(os.path.join(args.data, "cv"))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    cv_indices = list(range(rank, len(cv_set), world_size))

    model = UPITBLSTM(args.n_fft, args.hop, args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.7, patience=2)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    best = -float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        loss_acc = torch.zeros(2, device=device)
        for mix, ref in train_loader:
            mix, ref = mix.to(device, non_blocking=True), ref.to(device, non_blocking=True)
            loss = -upit_si_snr(model(mix), ref).mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        model.eval()
        cv_acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for i in cv_indices:
                mix, ref = cv_set[i]
                mix, ref = mix[None].to(device), ref[None].to(device)
                imp = upit_si_snr(model.module(mix), ref) - upit_si_snr(mix.unsqueeze(1).expand_as(ref), ref)
                cv_acc += torch.stack([imp.sum().double(), torch.ones((), device=device, dtype=torch.float64)])
        dist.all_reduce(cv_acc)
        cv_sisnri = (cv_acc[0] / cv_acc[1]).item()
        scheduler.step(cv_sisnri)

        if rank == 0:
            print(f"[{epoch:03d}] train {(loss_acc[0] / loss_acc[1]).item():.3f}  cv SI-SNRi {cv_sisnri:.2f} dB  "
                  f"{time.time() - start:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.exp, "last.pt"))
            if cv_sisnri > best:
                best = cv_sisnri
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
