#!/usr/bin/env python3
"""Conv-TasNet training on wsj0-2mix (8 kHz, min mode) with DDP.

Launch:
    torchrun --standalone --nproc_per_node=4 01_convtasnet_wsj0mix.py --data /data/wsj0-2mix/wav8k/min
"""
import argparse
import itertools
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("convtasnet")


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
class Wsj0MixDataset(Dataset):
    def __init__(self, root, split, n_src=2, sample_rate=8000, segment=4.0):
        self.root = os.path.join(root, split)
        self.n_src = n_src
        self.seg_len = None if segment is None else int(segment * sample_rate)
        names = sorted(f for f in os.listdir(os.path.join(self.root, "mix")) if f.endswith(".wav"))
        if self.seg_len is not None:
            names = [n for n in names if sf.info(os.path.join(self.root, "mix", n)).frames >= self.seg_len]
        self.names = names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, idx):
        name = self.names[idx]
        frames = sf.info(os.path.join(self.root, "mix", name)).frames
        start, stop = 0, None
        if self.seg_len is not None:
            start = random.randint(0, frames - self.seg_len)
            stop = start + self.seg_len
        mix, _ = sf.read(os.path.join(self.root, "mix", name), start=start, stop=stop, dtype="float32")
        srcs = [
            sf.read(os.path.join(self.root, f"s{i + 1}", name), start=start, stop=stop, dtype="float32")[0]
            for i in range(self.n_src)
        ]
        return torch.from_numpy(mix), torch.from_numpy(np.stack(srcs))


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
class GlobalLayerNorm(nn.Module):
    def __init__(self, channels, eps=1e-8):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(dim=(1, 2), keepdim=True)
        var = (x - mean).pow(2).mean(dim=(1, 2), keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta


class TemporalBlock(nn.Module):
    def __init__(self, in_ch, hid_ch, kernel, dilation, last=False):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(in_ch, hid_ch, 1),
            nn.PReLU(),
            GlobalLayerNorm(hid_ch),
            nn.Conv1d(hid_ch, hid_ch, kernel, padding=(kernel - 1) * dilation // 2,
                      dilation=dilation, groups=hid_ch),
            nn.PReLU(),
            GlobalLayerNorm(hid_ch),
        )
        self.res_out = None if last else nn.Conv1d(hid_ch, in_ch, 1)
        self.skip_out = nn.Conv1d(hid_ch, in_ch, 1)

    def forward(self, x):
        y = self.net(x)
        res = x if self.res_out is None else x + self.res_out(y)
        return res, self.skip_out(y)


class ConvTasNet(nn.Module):
    def __init__(self, n_src=2, N=512, L=16, B=128, H=512, P=3, X=8, R=3):
        super().__init__()
        self.n_src = n_src
        self.encoder = nn.Conv1d(1, N, L, stride=L // 2, bias=False)
        self.in_norm = GlobalLayerNorm(N)
        self.bottleneck = nn.Conv1d(N, B, 1)
        n_blocks = R * X
        self.tcn = nn.ModuleList(
            [TemporalBlock(B, H, P, 2 ** (i % X), last=(i == n_blocks - 1)) for i in range(n_blocks)]
        )
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(B, n_src * N, 1))
        self.decoder = nn.ConvTranspose1d(N, 1, L, stride=L // 2, bias=False)

    def forward(self, mix):
        T = mix.shape[-1]
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        x = self.bottleneck(self.in_norm(w))
        skip = 0.0
        for block in self.tcn:
            x, s = block(x)
            skip = skip + s
        m = torch.sigmoid(self.mask(skip)).view(mix.size(0), self.n_src, w.size(1), w.size(2))
        est = self.decoder((m * w.unsqueeze(1)).flatten(0, 1)).view(mix.size(0), self.n_src, -1)
        if est.size(-1) < T:
            est = F.pad(est, (0, T - est.size(-1)))
        return est[..., :T]


# ----------------------------------------------------------------------------
# losses / metrics
# ----------------------------------------------------------------------------
def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    """Returns the best-permutation SI-SNR per example, shape [B]."""
    n_src = est.size(1)
    pair = si_snr(est.unsqueeze(2), ref.unsqueeze(1))  # [B, est, ref]
    idx = torch.arange(n_src, device=est.device)
    scores = torch.stack([pair[:, idx, list(p)].mean(-1) for p in itertools.permutations(range(n_src))], 1)
    return scores.max(dim=1).values


# ----------------------------------------------------------------------------
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--exp_dir", default="exp/convtasnet_wsj0mix")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU; 4 x 4 GPUs = 16 as in the paper setup")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--segment", type=float, default=4.0)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for mix, srcs in loader:
        mix, srcs = mix.to(device), srcs.to(device)
        est = model(mix)
        base = pit_si_snr(mix.unsqueeze(1).expand_as(srcs), srcs)
        stats[0] += (pit_si_snr(est, srcs) - base).sum()
        stats[1] += mix.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)

    train_set = Wsj0MixDataset(args.data, "tr", segment=args.segment)
    valid_set = Wsj0MixDataset(args.data, "cv", segment=None)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    valid_shard = Subset(valid_set, list(range(rank, len(valid_set), world_size)))
    valid_loader = DataLoader(valid_shard, batch_size=1, num_workers=2)

    model = ConvTasNet().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    start_epoch, best = 0, -float("inf")
    ckpt_path = os.path.join(args.exp_dir, "last.pt")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        logger.info("resumed from epoch %d", ckpt["epoch"])

    logger.info("training on %d GPUs, %d train / %d valid utterances", world_size, len(train_set), len(valid_set))
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (mix, srcs) in enumerate(train_loader):
            mix = mix.to(device, non_blocking=True)
            srcs = srcs.to(device, non_blocking=True)
            loss = -pit_si_snr(model(mix), srcs).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.3f", epoch, step, loss.item())
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        sisnri = validate(model.module, valid_loader, device)
        scheduler.step(sisnri)
        logger.info("epoch %d | train loss %.3f | valid SI-SNRi %.2f dB | lr %.2e | %.0fs",
                    epoch, train_loss, sisnri, optimizer.param_groups[0]["lr"], time.time() - t0)

        if rank == 0:
            is_best = sisnri > best
            best = max(best, sisnri)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
