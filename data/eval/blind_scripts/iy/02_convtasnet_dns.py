"""Conv-TasNet (single output) for speech denoising, trained with SI-SNR on
on-the-fly DNS mixtures. Validation enhances full utterances in overlapping
chunks and scores them with PESQ / STOI; a handful of enhanced files are
written to disk for listening.

    torchrun --standalone --nproc_per_node=8 02_convtasnet_dns.py --config conf/tasnet_dns.yaml
"""
import argparse
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEFAULTS = dict(
    clean_list="lists/dns_clean_train.txt", noise_list="lists/dns_noise_train.txt",
    val_list="lists/dns_synthetic_test.jsonl", exp_dir="exp/tasnet_dns",
    sr=16000, segment=4.0, snr_min=-5.0, snr_max=15.0, batch_size=8, base_lr=1e-3,
    base_batch=32, epochs=100, workers=8, chunk_sec=4.0, n_listen=8,
)


class DNSMix(Dataset):
    def __init__(self, clean, noise, sr, segment, snr_min, snr_max):
        self.clean, self.noise = clean, noise
        self.n = int(sr * segment)
        self.snr_min, self.snr_max = snr_min, snr_max

    def __len__(self):
        return len(self.clean)

    def _load(self, path):
        wav, _ = sf.read(path, dtype="float32", always_2d=True)
        wav = wav[:, 0]
        if len(wav) < self.n:
            wav = np.pad(wav, (0, self.n - len(wav)), mode="wrap")
        off = random.randint(0, len(wav) - self.n)
        return wav[off:off + self.n]

    def __getitem__(self, i):
        s = self._load(self.clean[i])
        v = self._load(random.choice(self.noise))
        snr = random.uniform(self.snr_min, self.snr_max)
        gain = np.sqrt((s ** 2).mean() / ((v ** 2).mean() + 1e-9) / 10 ** (snr / 10))
        x = s + gain * v
        scale = 0.9 / max(np.abs(x).max(), 1e-4) if np.abs(x).max() > 0.9 else 1.0
        return torch.tensor(x * scale, dtype=torch.float32), torch.tensor(s * scale, dtype=torch.float32)


class GlobalLayerNorm(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, ch, 1))
        self.beta = nn.Parameter(torch.zeros(1, ch, 1))

    def forward(self, x):
        mean = x.mean(dim=(1, 2), keepdim=True)
        var = ((x - mean) ** 2).mean(dim=(1, 2), keepdim=True)
        return self.gamma * (x - mean) / torch.sqrt(var + 1e-8) + self.beta


class TCNBlock(nn.Module):
    def __init__(self, b, h, p, dilation):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(b, h, 1), nn.PReLU(), GlobalLayerNorm(h),
            nn.Conv1d(h, h, p, dilation=dilation, padding=dilation * (p - 1) // 2, groups=h),
            nn.PReLU(), GlobalLayerNorm(h), nn.Conv1d(h, b, 1))

    def forward(self, x):
        return x + self.net(x)


class ConvTasNet(nn.Module):
    def __init__(self, N=512, L=16, B=128, H=512, P=3, X=8, R=3):
        super().__init__()
        self.L = L
        self.encoder = nn.Conv1d(1, N, L, stride=L // 2, bias=False)
        self.bottleneck = nn.Sequential(GlobalLayerNorm(N), nn.Conv1d(N, B, 1))
        self.tcn = nn.Sequential(*[TCNBlock(B, H, P, 2 ** x) for _ in range(R) for x in range(X)])
        self.mask = nn.Conv1d(B, N, 1)
        self.decoder = nn.ConvTranspose1d(N, 1, L, stride=L // 2, bias=False)

    def forward(self, wav):
        T = wav.shape[-1]
        pad = (self.L // 2 - (T - self.L) % (self.L // 2)) % (self.L // 2)
        w = self.encoder(F.pad(wav, (0, pad)).unsqueeze(1))
        m = torch.sigmoid(self.mask(self.tcn(self.bottleneck(F.relu(w)))))
        return self.decoder(w * m).squeeze(1)[..., :T]


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def enhance_long(net, wav, chunk):
    """Overlap-add over 50%-overlapping Hann-weighted chunks of a 1-D waveform."""
    T = wav.shape[-1]
    if T <= chunk:
        return net(wav[None])[0]
    hop = chunk // 2
    n_chunks = math.ceil((T - chunk) / hop) + 1
    padded = F.pad(wav, (0, (n_chunks - 1) * hop + chunk - T))
    frames = padded.unfold(0, chunk, hop)            # (n_chunks, chunk)
    out_frames = torch.cat([net(f) for f in frames.split(4)])
    win = torch.hann_window(chunk, periodic=True, device=wav.device)
    out = torch.zeros_like(padded)
    norm = torch.zeros_like(padded)
    for k in range(n_chunks):
        out[k * hop:k * hop + chunk] += out_frames[k] * win
        norm[k * hop:k * hop + chunk] += win
    return (out / norm.clamp_min(1e-3))[:T]


def gather_ragged(x, world):
    """all_gather for 1-D tensors whose lengths differ between ranks."""
    n = torch.tensor([x.numel()], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    buf = [torch.zeros(max_n, device=x.device, dtype=x.dtype) for _ in range(world)]
    dist.all_gather(buf, F.pad(x, (0, max_n - x.numel())))
    return [b[:int(s.item())] for b, s in zip(buf, sizes)]


@torch.no_grad()
def evaluate(net, items, cfg, rank, world, device, epoch):
    net.eval()
    chunk = int(cfg["chunk_sec"] * cfg["sr"])
    rows = []
    mine = items[rank::world]
    for it in mine:
        noisy, _ = sf.read(it["noisy"], dtype="float32")
        clean, _ = sf.read(it["clean"], dtype="float32")
        est = enhance_long(net, torch.from_numpy(noisy).to(device), chunk).cpu().numpy()
        rows.append({"id": it["id"], "pesq": float(pesq(cfg["sr"], clean, est, "wb")),
                     "stoi": float(stoi(clean, est, cfg["sr"])),
                     "si_snr": float(si_snr(torch.from_numpy(est), torch.from_numpy(clean)))})
    all_rows = [None] * world
    dist.all_gather_object(all_rows, rows)

    # the first n_listen utterances are always on ranks 0..n_listen-1 (one each)
    if rank < min(cfg["n_listen"], len(items)) and len(mine) > 0:
        first = torch.from_numpy(sf.read(mine[0]["noisy"], dtype="float32")[0]).to(device)
        listen = enhance_long(net, first, chunk)
    else:
        listen = torch.zeros(0, device=device)
    gathered = gather_ragged(listen, world)
    net.train()
    if rank != 0:
        return None
    rows = [r for part in all_rows for r in part]
    out = Path(cfg["exp_dir"]) / f"listen_ep{epoch:03d}"
    out.mkdir(parents=True, exist_ok=True)
    for r, wav in enumerate(gathered):
        if wav.numel():
            sf.write(out / f"{items[r]['id']}.wav", wav.cpu().numpy(), cfg["sr"])
    with open(out / "scores.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return {k: float(np.mean([r[k] for r in rows])) for k in ("pesq", "stoi", "si_snr")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        cfg.update(yaml.safe_load(open(args.config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    clean = [l.strip() for l in open(cfg["clean_list"]) if l.strip()]
    noise = [l.strip() for l in open(cfg["noise_list"]) if l.strip()]
    val_items = [json.loads(l) for l in open(cfg["val_list"])]

    ds = DNSMix(clean, noise, cfg["sr"], cfg["segment"], cfg["snr_min"], cfg["snr_max"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                    pin_memory=True, drop_last=True)

    net = ConvTasNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    # linear scaling from the reference recipe (base_lr at base_batch)
    lr = cfg["base_lr"] * cfg["batch_size"] * world / cfg["base_batch"]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(dl))

    Path(cfg["exp_dir"]).mkdir(parents=True, exist_ok=True)
    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, s) in enumerate(dl):
            x, s = x.to(device, non_blocking=True), s.to(device, non_blocking=True)
            loss = -si_snr(model(x), s).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(dl)} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        scores = evaluate(net, val_items, cfg, rank, world, device, epoch)
        if rank == 0:
            print(f"ep {epoch} val {scores}", flush=True)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "cfg": cfg}
            torch.save(ckpt, Path(cfg["exp_dir"]) / "last.pt")
            if scores["pesq"] > best:
                best = scores["pesq"]
                torch.save(ckpt, Path(cfg["exp_dir"]) / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
