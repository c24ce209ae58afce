"""DCUNet-style complex U-Net for speech enhancement on VoiceBank-DEMAND (16 kHz).

  torchrun --standalone --nproc_per_node=4 07_dcunet_voicebank.py --data /data/voicebank_demand_16k --accum 2
"""
import argparse
import contextlib
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--exp", default="exp/dcunet_vb")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch", type=int, default=16, help="per-GPU micro batch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--segment", type=float, default=2.0)
    p.add_argument("--n_fft", type=int, default=512)
    p.add_argument("--hop", type=int, default=128)
    p.add_argument("--resume", default="")
    return p.parse_args()


class VoiceBank(Dataset):
    def __init__(self, root, split, segment=None, sr=16000):
        self.noisy_dir = os.path.join(root, f"noisy_{split}set_wav")
        self.clean_dir = os.path.join(root, f"clean_{split}set_wav")
        self.files = sorted(os.listdir(self.noisy_dir))
        self.seg = int(segment * sr) if segment else None

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        noisy, _ = sf.read(os.path.join(self.noisy_dir, self.files[i]), dtype="float32")
        clean, _ = sf.read(os.path.join(self.clean_dir, self.files[i]), dtype="float32")
        if self.seg:
            if len(noisy) < self.seg:
                pad = self.seg - len(noisy)
                noisy, clean = np.pad(noisy, (0, pad)), np.pad(clean, (0, pad))
            else:
                o = random.randint(0, len(noisy) - self.seg)
                noisy, clean = noisy[o:o + self.seg], clean[o:o + self.seg]
        return torch.from_numpy(noisy), torch.from_numpy(clean)


class CConv(nn.Module):
    def __init__(self, cin, cout, transposed=False, last=False):
        super().__init__()
        if transposed:
            conv = lambda: nn.ConvTranspose2d(cin, cout, (5, 3), (2, 1), (2, 1), output_padding=(1, 0))
        else:
            conv = lambda: nn.Conv2d(cin, cout, (5, 3), (2, 1), (2, 1))
        self.re, self.im = conv(), conv()
        self.post = nn.Identity() if last else nn.Sequential(nn.BatchNorm2d(2 * cout), nn.LeakyReLU(0.1))

    def forward(self, x):
        xr, xi = torch.chunk(x, 2, dim=1)
        return self.post(torch.cat([self.re(xr) - self.im(xi), self.re(xi) + self.im(xr)], 1))


class DCUNet(nn.Module):
    def __init__(self, n_fft=512, hop=128, chans=(32, 64, 64, 64, 64)):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        c = (1,) + tuple(chans)
        self.down = nn.ModuleList([CConv(c[i], c[i + 1]) for i in range(len(chans))])
        ups = []
        for i in reversed(range(len(chans))):
            cin = c[i + 1] if i == len(chans) - 1 else 2 * c[i + 1]
            ups.append(CConv(cin, c[i] if i > 0 else 1, transposed=True, last=(i == 0)))
        self.up = nn.ModuleList(ups)

    def forward(self, wav):
        n = wav.size(-1)
        spec = torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)[:, :-1]
        x = torch.stack([spec.real, spec.imag], 1)
        skips = []
        for d in self.down:
            x = d(x)
            skips.append(x)
        skips.pop()
        for j, u in enumerate(self.up):
            if j > 0:
                s = skips.pop()
                xr, xi = x.chunk(2, 1)
                sr, si = s.chunk(2, 1)
                x = torch.cat([xr, sr, xi, si], 1)
            x = u(x)
        m = torch.complex(x[:, 0], x[:, 1])
        m = torch.tanh(m.abs()) * torch.exp(1j * m.angle())
        est = F.pad(spec * m, (0, 0, 0, 1))
        return torch.istft(est, self.n_fft, self.hop, window=self.window, length=n)


def wsdr_loss(noisy, est, clean, eps=1e-8):
    def neg_cos(a, b):
        return -(a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + eps)

    noise, est_noise = noisy - clean, noisy - est
    a = clean.pow(2).sum(-1) / (clean.pow(2).sum(-1) + noise.pow(2).sum(-1) + eps)
    return (a * neg_cos(clean, est) + (1 - a) * neg_cos(noise, est_noise)).mean()


@torch.no_grad()
def evaluate(net, test_set, rank, world):
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64).cuda()
    for i in range(rank, len(test_set), world):
        noisy, clean = test_set[i]
        enh = net(noisy.cuda()[None])[0].cpu().numpy()
        ref = clean.numpy()
        sums[0] += pesq(16000, ref, enh, "wb")
        sums[1] += stoi(ref, enh, 16000)
        sums[2] += 1
    dist.all_reduce(sums)
    net.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    random.seed(rank)

    train_set = VoiceBank(args.data, "train", segment=args.segment)
    test_set = VoiceBank(args.data, "test")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    net = DCUNet(args.n_fft, args.hop)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    net = DDP(net.cuda(), device_ids=[torch.cuda.current_device()])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        del ckpt

    tb = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    step = 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        opt.zero_grad(set_to_none=True)
        for i, (noisy, clean) in enumerate(loader):
            noisy, clean = noisy.cuda(non_blocking=True), clean.cuda(non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if boundary else net.no_sync():
                loss = wsdr_loss(noisy, net(noisy), clean) / args.accum
                loss.backward()
            if boundary:
                nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if tb is not None and step % 50 == 0:
                    tb.add_scalar("train/wsdr", loss.item() * args.accum, step)
        sched.step()

        pesq_wb, stoi_s = evaluate(net.module, test_set, rank, world)
        if rank == 0:
            tb.add_scalar("test/pesq_wb", pesq_wb, epoch)
            tb.add_scalar("test/stoi", stoi_s, epoch)
            print(f"[epoch {epoch}] PESQ-WB {pesq_wb:.3f}  STOI {stoi_s:.4f}", flush=True)
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.exp, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
