"""Stage-1 pretraining of a SoundStream-like codec (no adversarial losses yet).

Reconstruction-only warm start: multi-scale spectral loss + waveform L1 + VQ losses.
Bitrate scalability comes from sampling the number of active RVQ stages per batch
(quantizer dropout), so a single model serves 1.5 / 3 / 6 / 12 kbps.

    torchrun --nproc_per_node=8 05_soundstream_rvq_pretrain.py --train data/train_24k.txt \
        --valid data/valid_24k.txt --out /shared/exp/ss_stage1
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SAMPLE_RATE = 24000
HOP = 320  # strides 2*4*5*8
BITRATE_TO_NQ = {1.5: 2, 3.0: 4, 6.0: 8, 12.0: 16}


class ClipDataset(Dataset):
    def __init__(self, list_file, seconds, train=True):
        self.files = [l.rstrip() for l in open(list_file)]
        self.n = int(seconds * SAMPLE_RATE) // HOP * HOP
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        if sr != SAMPLE_RATE:
            wav = torchaudio.functional.resample(wav, sr, SAMPLE_RATE)
        wav = wav[:1]
        if wav.shape[-1] > self.n:
            s = random.randrange(wav.shape[-1] - self.n) if self.train else 0
            wav = wav[:, s : s + self.n]
        return F.pad(wav, (0, self.n - wav.shape[-1]))


class CausalConv(nn.Conv1d):
    def forward(self, x):
        pad = (self.kernel_size[0] - 1) * self.dilation[0] - (self.stride[0] - 1)
        return super().forward(F.pad(x, (max(pad, 0), 0)))


class EncBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.res = nn.ModuleList(
            nn.Sequential(CausalConv(cin, cin, 7, dilation=d), nn.ELU(), CausalConv(cin, cin, 1), nn.ELU())
            for d in (1, 3, 9)
        )
        self.down = CausalConv(cin, cout, 2 * stride, stride=stride)

    def forward(self, x):
        for r in self.res:
            x = x + r(x)
        return F.elu(self.down(x))


class DecBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.up = nn.ConvTranspose1d(cin, cout, 2 * stride, stride=stride)
        self.stride = stride
        self.res = nn.ModuleList(
            nn.Sequential(CausalConv(cout, cout, 7, dilation=d), nn.ELU(), CausalConv(cout, cout, 1), nn.ELU())
            for d in (1, 3, 9)
        )

    def forward(self, x):
        x = F.elu(self.up(x)[..., : x.shape[-1] * self.stride])
        for r in self.res:
            x = x + r(x)
        return x


class Codebook(nn.Module):
    def __init__(self, size, dim):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(size, dim) * 0.02)

    def forward(self, z):  # z: [B, T, D]
        d = (z.pow(2).sum(-1, keepdim=True) - 2 * z @ self.embed.t() + self.embed.pow(2).sum(-1))
        idx = d.argmin(-1)
        q = F.embedding(idx, self.embed)
        loss = F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())
        return z + (q - z).detach(), idx, loss


class RVQ(nn.Module):
    def __init__(self, n_q, size, dim):
        super().__init__()
        self.codebooks = nn.ModuleList(Codebook(size, dim) for _ in range(n_q))

    def forward(self, z, n_q):
        out, res, loss, idxs = torch.zeros_like(z), z, 0.0, []
        for cb in self.codebooks[:n_q]:
            q, idx, l = cb(res)
            out, res, loss = out + q, res - q.detach(), loss + l
            idxs.append(idx)
        return out, torch.stack(idxs, 1), loss / n_q


class SoundStream(nn.Module):
    def __init__(self, ch=32, dim=256, n_q=16, codebook_size=1024, strides=(2, 4, 5, 8)):
        super().__init__()
        enc, c = [CausalConv(1, ch, 7)], ch
        for s in strides:
            enc.append(EncBlock(c, c * 2, s))
            c *= 2
        enc.append(CausalConv(c, dim, 3))
        self.encoder = nn.Sequential(*enc)
        self.rvq = RVQ(n_q, codebook_size, dim)
        dec = [CausalConv(dim, c, 7)]
        for s in reversed(strides):
            dec.append(DecBlock(c, c // 2, s))
            c //= 2
        dec.append(CausalConv(c, 1, 7))
        self.decoder = nn.Sequential(*dec)

    def forward(self, wav, n_q):
        z = self.encoder(wav).transpose(1, 2)
        zq, codes, vq_loss = self.rvq(z, n_q)
        return self.decoder(zq.transpose(1, 2)), codes, vq_loss


class SpectralLoss(nn.Module):
    def __init__(self, fft_sizes=(64, 128, 256, 512, 1024, 2048)):
        super().__init__()
        self.mels = nn.ModuleList(
            torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=n, win_length=n, hop_length=n // 4,
                                                 n_mels=64 if n >= 256 else n // 4, power=1.0)
            for n in fft_sizes
        )

    def forward(self, x, y):
        loss = 0.0
        for m in self.mels:
            sx, sy = m(x) + 1e-5, m(y) + 1e-5
            alpha = (m.n_fft / 2) ** 0.5
            loss = loss + (sx - sy).abs().mean() + alpha * (sx.log() - sy.log()).pow(2).mean().sqrt()
        return loss / len(self.mels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=256, help="global")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=250_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds = ClipDataset(args.train, args.seconds)
    valid_ds = ClipDataset(args.valid, 5.0, train=False)
    sampler = DistributedSampler(train_ds, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    valid_idx = list(range(rank, len(valid_ds), world))

    model = SoundStream().to(dev)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999996)
    spec_loss = SpectralLoss().to(dev)
    nq_choices = list(BITRATE_TO_NQ.values())

    os.makedirs(args.out, exist_ok=True)
    ckpt_file = os.path.join(args.out, "latest.pt")
    step = 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]

    epoch = step // len(loader)
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for wav in loader:
            wav = wav.to(dev, non_blocking=True)
            n_q = random.choice(nq_choices)
            rec, _, vq_loss = model(wav, n_q)
            loss_spec = spec_loss(rec, wav)
            loss_wav = F.l1_loss(rec, wav)
            loss = loss_spec + 0.1 * loss_wav + vq_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            if step % 200 == 0:
                stats = torch.tensor([loss_spec.item(), loss_wav.item(), vq_loss.item()], device=dev)
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"{step:>7d} spec {stats[0]:.4f} l1 {stats[1]:.4f} vq {stats[2]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic) / 200:.3f}s/step", flush=True)
                tic = time.time()

            if step % 5000 == 0:
                model.eval()
                acc = torch.zeros(len(nq_choices) + 1, device=dev)
                with torch.no_grad():
                    for i in valid_idx:
                        x = valid_ds[i].unsqueeze(0).to(dev)
                        for j, nq in enumerate(nq_choices):
                            y = model.module(x, nq)[0]
                            acc[j] += spec_loss(y, x)
                        acc[-1] += 1
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    msg = " ".join(f"{kbps}kbps={(acc[j] / acc[-1]).item():.4f}"
                                   for j, kbps in enumerate(BITRATE_TO_NQ))
                    print(f"[valid {step}] {msg}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ckpt_file + ".tmp")
                    os.replace(ckpt_file + ".tmp", ckpt_file)
                dist.barrier()

            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
