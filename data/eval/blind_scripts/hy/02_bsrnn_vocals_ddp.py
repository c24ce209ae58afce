"""Band-Split RNN, vocals only. torchrun --nproc_per_node=8 02_bsrnn_vocals_ddp.py --config conf/bsrnn_vocals.yaml"""
import argparse
import contextlib
import logging
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("bsrnn")
STEMS = ("vocals", "drums", "bass", "other")


def band_edges(sr, n_fft):
    hz_per_bin = sr / n_fft
    plan = [(1000, 100), (4000, 250), (8000, 500), (16000, 1000), (20000, 2000)]
    edges, f = [0], 0
    for upper, bw in plan:
        while f + bw <= upper:
            f += bw
            edges.append(int(round(f / hz_per_bin)))
    edges.append(n_fft // 2 + 1)
    return sorted(set(edges))


class DualPath(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.t_norm, self.k_norm = nn.GroupNorm(1, d), nn.GroupNorm(1, d)
        self.t_rnn = nn.LSTM(d, hidden, batch_first=True, bidirectional=True)
        self.k_rnn = nn.LSTM(d, hidden, batch_first=True, bidirectional=True)
        self.t_fc, self.k_fc = nn.Linear(2 * hidden, d), nn.Linear(2 * hidden, d)

    def forward(self, z):  # B K N D
        B, K, N, D = z.shape
        y = self.t_norm(z.reshape(B * K, N, D).transpose(1, 2)).transpose(1, 2)
        z = z + self.t_fc(self.t_rnn(y)[0]).view(B, K, N, D)
        y = z.transpose(1, 2).reshape(B * N, K, D)
        y = self.k_norm(y.transpose(1, 2)).transpose(1, 2)
        z = z + self.k_fc(self.k_rnn(y)[0]).view(B, N, K, D).transpose(1, 2)
        return z


class BSRNN(nn.Module):
    def __init__(self, sr=44100, n_fft=2048, hop=512, channels=2, feat=128, hidden=256, layers=12):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        edges = band_edges(sr, n_fft)
        self.bands = list(zip(edges[:-1], edges[1:]))
        self.split = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(4 * (hi - lo)), nn.Linear(4 * (hi - lo), feat)) for lo, hi in self.bands)
        self.blocks = nn.ModuleList(DualPath(feat, hidden) for _ in range(layers))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(feat), nn.Linear(feat, 4 * feat), nn.Tanh(),
                          nn.Linear(4 * feat, 2 * 2 * channels * (hi - lo)), nn.GLU(-1))
            for lo, hi in self.bands)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, mix):
        B, C, T = mix.shape
        spec = torch.stft(mix.reshape(B * C, T), self.n_fft, self.hop, window=self.window, return_complex=True)
        spec = spec.view(B, C, *spec.shape[-2:])
        x = torch.view_as_real(spec)
        N = x.shape[3]
        z = torch.stack([proj(x[:, :, lo:hi].permute(0, 3, 1, 2, 4).reshape(B, N, -1))
                         for (lo, hi), proj in zip(self.bands, self.split)], dim=1)
        for blk in self.blocks:
            z = blk(z)
        masks = [head(z[:, k]).view(B, N, C, hi - lo, 2).permute(0, 2, 3, 1, 4)
                 for k, ((lo, hi), head) in enumerate(zip(self.bands, self.heads))]
        mask = torch.view_as_complex(torch.cat(masks, dim=2).contiguous())
        est = (spec * mask).reshape(B * C, -1, N)
        return torch.istft(est, self.n_fft, self.hop, window=self.window, length=T).view(B, C, T)


class VocalRemix(Dataset):
    def __init__(self, root, names, seconds, sr, items):
        self.root, self.names, self.sr, self.items = Path(root), names, sr, items
        self.n = int(seconds * sr)
        self.lengths = {name: torchaudio.info(str(self.root / name / "mixture.wav")).num_frames for name in names}
        self.epoch = 0

    def __len__(self):
        return self.items

    def load(self, name, stem, rng):
        start = rng.randrange(max(1, self.lengths[name] - self.n))
        wav, _ = torchaudio.load(str(self.root / name / f"{stem}.wav"), frame_offset=start, num_frames=self.n)
        return F.pad(wav, (0, self.n - wav.shape[-1])) * rng.uniform(0.5, 1.2)

    def __getitem__(self, i):
        rng = random.Random(hash((self.epoch, i)))
        stems = {s: self.load(rng.choice(self.names), s, rng) for s in STEMS}
        if rng.random() < 0.1:
            stems["vocals"].zero_()
        mix = sum(stems.values())
        return mix, stems["vocals"]


def sdr(ref, est, eps=1e-7):
    return 10 * torch.log10((ref.pow(2).sum() + eps) / ((ref - est).pow(2).sum() + eps))


@torch.no_grad()
def separate_full(model, mix, chunk, hop, dev):
    T = mix.shape[-1]
    pad = chunk - hop
    padded = F.pad(mix, (pad, pad + chunk))
    fade = torch.hann_window(chunk, periodic=False, device=dev)
    out = torch.zeros(mix.shape[0], padded.shape[-1], device=dev)
    norm = torch.zeros(padded.shape[-1], device=dev)
    for s in range(0, padded.shape[-1] - chunk + 1, hop):
        seg = padded[:, s:s + chunk].unsqueeze(0).to(dev)
        out[:, s:s + chunk] += model(seg)[0] * fade
        norm[s:s + chunk] += fade
    return (out / norm.clamp_min(1e-4))[:, pad:pad + T].cpu()


def evaluate(model, root, names, cfg, dev):
    """Tracks are split round-robin, so ranks may get a different number of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model.module
    net.eval()
    chunk = int(cfg["chunk_seconds"] * cfg["sr"])
    acc = torch.zeros(2, device=dev, dtype=torch.float64)
    for name in names[rank::world]:
        mix, _ = torchaudio.load(str(Path(root) / name / "mixture.wav"))
        ref, _ = torchaudio.load(str(Path(root) / name / "vocals.wav"))
        est = separate_full(net, mix, chunk, chunk // 2, dev)
        acc[0] += sdr(ref, est).item()
        acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    cfg = yaml.safe_load(open(ap.parse_args().config))
    resume = ap.parse_args().resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    dev = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(cfg["seed"])

    train_names = [l.strip() for l in open(cfg["train_list"]) if l.strip()]
    valid_names = [l.strip() for l in open(cfg["valid_list"]) if l.strip()]
    ds = VocalRemix(cfg["data_root"], train_names, cfg["seconds"], cfg["sr"], cfg["items_per_epoch"])
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=cfg["workers"],
                    pin_memory=True, drop_last=True)

    model = BSRNN(sr=cfg["sr"], layers=cfg["layers"]).to(dev)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    # cfg["lr"] is tuned for cfg["ref_batch"] examples per optimizer step; scale linearly with the real one
    accum = cfg.get("accum", 1)
    global_batch = cfg["batch_per_gpu"] * accum * dist.get_world_size()
    lr = cfg["lr"] * global_batch / cfg["ref_batch"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.get("wd", 0.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.98)
    out_dir = Path(cfg["out_dir"])
    start_epoch, best = 0, -1e9

    if resume:
        ck = torch.load(resume, map_location=dev)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        log.info("global batch %d, lr %.2e", global_batch, lr)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        ds.epoch = epoch
        running = torch.zeros(2, device=dev)
        for step, (mix, voc) in enumerate(dl):
            mix, voc = mix.to(dev, non_blocking=True), voc.to(dev, non_blocking=True)
            sync_now = (step + 1) % accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                est = model(mix)
                loss = F.l1_loss(est, voc) + F.l1_loss(
                    torch.stft(est.flatten(0, 1), 2048, 512, window=model.module.window, return_complex=True).abs(),
                    torch.stft(voc.flatten(0, 1), 2048, 512, window=model.module.window, return_complex=True).abs())
                (loss / accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            running += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()
        dist.all_reduce(running)
        log.info("epoch %d train loss %.4f", epoch, (running[0] / running[1]).item())

        if (epoch + 1) % cfg["eval_every"] == 0:
            score = evaluate(model, cfg["data_root"], valid_names, cfg, dev)
            log.info("epoch %d valid vocals SDR %.3f dB", epoch, score)
            if rank == 0:
                is_best = score > best
                best = max(best, score)
                ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                      "epoch": epoch, "best": best}
                torch.save(ck, out_dir / "last.pt")
                if is_best:
                    torch.save(model.module.state_dict(), out_dir / "best_vocals.pt")
            best = max(best, score)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
