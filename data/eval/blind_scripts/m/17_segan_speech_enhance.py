"""
SEGAN-style speech enhancement (VoiceBank-DEMAND, 16 kHz). Generator = 1D conv encoder/decoder
with skip connections, discriminator = conv net on (noisy, clean|enhanced) pairs, LSGAN losses + L1.

    torchrun --nproc_per_node=4 17_segan_speech_enhance.py --clean_dir vb/clean_trainset_28spk_wav \
        --noisy_dir vb/noisy_trainset_28spk_wav
"""
import argparse
import glob
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SEG = 16384  # ~1 s windows
PREEMPH = 0.95


def pre_emphasis(x, c=PREEMPH):
    return np.concatenate([x[:1], x[1:] - c * x[:-1]]).astype(np.float32)


class PairedSegments(Dataset):
    def __init__(self, clean_dir, noisy_dir, stride=SEG // 2):
        self.items = []
        names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(clean_dir, "*.wav")))
        self.clean, self.noisy = {}, {}
        for n in names:
            c, sr = sf.read(os.path.join(clean_dir, n), dtype="float32")
            x, _ = sf.read(os.path.join(noisy_dir, n), dtype="float32")
            assert sr == 16000, n
            self.clean[n], self.noisy[n] = pre_emphasis(c), pre_emphasis(x)
            L = len(c)
            starts = list(range(0, max(1, L - SEG + 1), stride))
            self.items.extend((n, s) for s in starts)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        n, s = self.items[i]
        c, x = self.clean[n][s:s + SEG], self.noisy[n][s:s + SEG]
        if len(c) < SEG:
            c = np.pad(c, (0, SEG - len(c)))
            x = np.pad(x, (0, SEG - len(x)))
        return torch.from_numpy(x)[None], torch.from_numpy(c)[None]


class Generator(nn.Module):
    def __init__(self, chans=(16, 32, 32, 64, 64, 128, 128, 256, 256, 512, 1024)):
        super().__init__()
        self.enc = nn.ModuleList()
        cin = 1
        for c in chans:
            self.enc.append(nn.Sequential(nn.Conv1d(cin, c, 31, 2, 15), nn.PReLU(c)))
            cin = c
        self.dec = nn.ModuleList()
        rev = list(chans[::-1])
        for k in range(len(rev)):
            cout = rev[k + 1] if k + 1 < len(rev) else 1
            cin_d = rev[k] * 2  # latent z concat at the bottleneck, skip concat otherwise
            last = k == len(rev) - 1
            self.dec.append(nn.Sequential(nn.ConvTranspose1d(cin_d, cout, 32, 2, 15),
                                          nn.Tanh() if last else nn.PReLU(cout)))

    def forward(self, x):
        skips = []
        for layer in self.enc:
            x = layer(x)
            skips.append(x)
        z = torch.randn_like(x)
        h = torch.cat([x, z], 1)
        skips.pop()
        for k, layer in enumerate(self.dec):
            h = layer(h)
            if skips:
                h = torch.cat([h, skips.pop()], 1)
        return h


class Discriminator(nn.Module):
    def __init__(self, chans=(32, 64, 64, 128, 128, 256, 256, 512, 512, 1024, 2048)):
        super().__init__()
        layers, cin = [], 2
        for c in chans:
            layers += [nn.Conv1d(cin, c, 31, 2, 15), nn.BatchNorm1d(c), nn.LeakyReLU(0.3)]
            cin = c
        self.body = nn.Sequential(*layers)
        self.out = nn.Sequential(nn.Conv1d(cin, 1, 1), nn.Flatten(), nn.Linear(SEG // 2 ** len(chans), 1))

    def forward(self, noisy, candidate):
        return self.out(self.body(torch.cat([noisy, candidate], 1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean_dir", required=True)
    ap.add_argument("--noisy_dir", required=True)
    ap.add_argument("--epochs", type=int, default=86)
    ap.add_argument("--batch_size", type=int, default=100)
    ap.add_argument("--g_lr", type=float, default=2e-4)
    ap.add_argument("--d_lr", type=float, default=2e-4)
    ap.add_argument("--l1_weight", type=float, default=100.0)
    ap.add_argument("--save_dir", default="segan_ckpt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    ds = PairedSegments(args.clean_dir, args.noisy_dir)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    if rank == 0:
        print(f"{len(ds)} segments, {len(dl)} steps/epoch/rank")
        os.makedirs(args.save_dir, exist_ok=True)

    G = DDP(Generator().to(device), device_ids=[local_rank])
    D = DDP(Discriminator().to(device), device_ids=[local_rank])
    g_opt = torch.optim.RMSprop(G.parameters(), lr=args.g_lr)
    d_opt = torch.optim.RMSprop(D.parameters(), lr=args.d_lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        logs = torch.zeros(4, device=device)
        for noisy, clean in dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            enhanced = G(noisy)

            # --- discriminator (LSGAN): real -> 1, fake -> 0
            d_real = D(noisy, clean)
            d_fake = D(noisy, enhanced.detach())
            d_loss = 0.5 * ((d_real - 1) ** 2).mean() + 0.5 * (d_fake ** 2).mean()
            d_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            d_opt.step()

            # --- generator
            g_adv = 0.5 * ((D(noisy, enhanced) - 1) ** 2).mean()
            g_l1 = F.l1_loss(enhanced, clean)
            g_loss = g_adv + args.l1_weight * g_l1
            g_opt.zero_grad(set_to_none=True)
            g_loss.backward()
            g_opt.step()

            logs += torch.stack([d_loss.detach(), g_adv.detach(), g_l1.detach(), torch.ones((), device=device)])
        dist.all_reduce(logs)
        logs = (logs[:3] / logs[3]).tolist()
        if rank == 0:
            print(f"epoch {epoch:03d} D {logs[0]:.4f} G_adv {logs[1]:.4f} L1 {logs[2]:.5f} ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "epoch": epoch},
                       os.path.join(args.save_dir, f"segan_e{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
