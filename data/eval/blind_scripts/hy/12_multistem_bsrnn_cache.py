"""
Band-split RNN with a shared trunk and one mask head per stem, trained on MUSDB18 (.stem.mp4).

Decoding mp4 stems is far too slow for random excerpts of long tracks, so the first run
decodes every track once into float16 .npy arrays that the workers memory-map.

    torchrun --nproc_per_node=8 12_multistem_bsrnn_cache.py --musdb /data/musdb18 --cache /data/cache/musdb_npy
"""
import argparse
import datetime
import os
import random
import time
from pathlib import Path

import numpy as np
import stempeg
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STEM_ORDER = ["mixture", "drums", "bass", "other", "vocals"]
TARGETS = ["drums", "bass", "other", "vocals"]


def build_cache(musdb_root, cache_dir):
    cache_dir.mkdir(parents=True, exist_ok=True)
    for subset in ("train", "test"):
        for mp4 in sorted((musdb_root / subset).glob("*.stem.mp4")):
            dst = cache_dir / subset / (mp4.name[: -len(".stem.mp4")] + ".npy")
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            audio, rate = stempeg.read_stems(str(mp4), sample_rate=44100)
            arr = np.ascontiguousarray(audio[1:].transpose(0, 2, 1)).astype(np.float16)  # (4, C, T)
            tmp = dst.with_suffix(".tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, dst)


class CachedRemix(Dataset):
    def __init__(self, files, seconds, items, sr=44100):
        self.files = files
        self.n = int(seconds * sr)
        self.items = items
        self.lengths = [np.load(f, mmap_mode="r").shape[-1] for f in files]
        self._arrays = None

    def __len__(self):
        return self.items

    def _open(self):
        if self._arrays is None:
            self._arrays = [np.load(f, mmap_mode="r") for f in self.files]
        return self._arrays

    def __getitem__(self, idx):
        arrays = self._open()
        out = np.zeros((len(TARGETS), 2, self.n), dtype=np.float32)
        for s in range(len(TARGETS)):
            k = random.randrange(len(arrays))
            off = random.randint(0, max(0, self.lengths[k] - self.n))
            seg = arrays[k][s, :, off:off + self.n].astype(np.float32)
            out[s, :, :seg.shape[-1]] = seg * random.uniform(0.3, 1.2)
        return torch.from_numpy(out)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.na, self.nb = nn.GroupNorm(1, d), nn.GroupNorm(1, d)
        self.ra = nn.LSTM(d, h, batch_first=True, bidirectional=True)
        self.rb = nn.LSTM(d, h, batch_first=True, bidirectional=True)
        self.pa, self.pb = nn.Linear(2 * h, d), nn.Linear(2 * h, d)

    def forward(self, z):
        B, K, T, D = z.shape
        y = self.na(z.reshape(B * K, T, D).transpose(1, 2)).transpose(1, 2)
        z = z + self.pa(self.ra(y)[0]).reshape(B, K, T, D)
        y = z.transpose(1, 2).reshape(B * T, K, D)
        y = self.nb(y.transpose(1, 2)).transpose(1, 2)
        return z + self.pb(self.rb(y)[0]).reshape(B, T, K, D).transpose(1, 2)


class MultiHeadBSRNN(nn.Module):
    def __init__(self, n_fft=2048, hop=512, d=96, h=192, depth=6, ch=2):
        super().__init__()
        self.n_fft, self.hop, self.ch = n_fft, hop, ch
        widths = [4] * 24 + [8] * 16 + [16] * 16 + [32] * 8 + [64] * 4
        edges = np.minimum(np.cumsum([0] + widths), n_fft // 2 + 1)
        edges = sorted(set(edges.tolist()) | {n_fft // 2 + 1})
        self.bands = list(zip(edges[:-1], edges[1:]))
        self.split = nn.ModuleList(nn.Sequential(nn.LayerNorm(2 * ch * (b - a)), nn.Linear(2 * ch * (b - a), d))
                                   for a, b in self.bands)
        self.trunk = nn.ModuleList(Block(d, h) for _ in range(depth))
        self.heads = nn.ModuleDict({
            t: nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Tanh(),
                                           nn.Linear(2 * d, 2 * 2 * ch * (b - a)), nn.GLU(-1)) for a, b in self.bands)
            for t in TARGETS})
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, mix, target):
        B, C, N = mix.shape
        Z = torch.stft(mix.reshape(B * C, N), self.n_fft, self.hop, window=self.window, return_complex=True)
        Z = Z.reshape(B, C, *Z.shape[-2:])
        X = torch.view_as_real(Z).permute(0, 3, 1, 2, 4)
        T = X.shape[1]
        z = torch.stack([p(X[:, :, :, a:b].reshape(B, T, -1)) for (a, b), p in zip(self.bands, self.split)], 1)
        for blk in self.trunk:
            z = blk(z)
        m = [head(z[:, k]).reshape(B, T, C, b - a, 2) for k, ((a, b), head) in enumerate(zip(self.bands, self.heads[target]))]
        mask = torch.view_as_complex(torch.cat(m, dim=3).permute(0, 2, 3, 1, 4).contiguous())
        est = (Z * mask).reshape(B * C, *Z.shape[-2:])
        return torch.istft(est, self.n_fft, self.hop, window=self.window, length=N).reshape(B, C, N)


@torch.no_grad()
def eval_track(net, arr, device, chunk=44100 * 12, hop=44100 * 6):
    stems = torch.from_numpy(arr.astype(np.float32))
    mix = stems.sum(0)
    N = mix.shape[-1]
    fade = torch.hann_window(chunk, periodic=False).clamp_min(1e-3).to(device)
    scores = []
    for k, t in enumerate(TARGETS):
        acc = torch.zeros(2, N + chunk, device=device)
        wsum = torch.zeros(N + chunk, device=device)
        for s in range(0, N, hop):
            seg = F.pad(mix[:, s:s + chunk], (0, max(0, s + chunk - N))).to(device)
            acc[:, s:s + chunk] += net(seg[None], t)[0] * fade
            wsum[s:s + chunk] += fade
        est = (acc / wsum.clamp_min(1e-6))[:, :N]
        ref = stems[k].to(device)
        scores.append(10 * torch.log10(ref.pow(2).sum() / (ref - est).pow(2).sum().clamp_min(1e-9)))
    return torch.stack(scores)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--musdb", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("exp/mh_bsrnn"))
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--items", type=int, default=32000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--n-valid", type=int, default=14)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the first run decodes the whole dataset on rank 0 before the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    if rank == 0:
        build_cache(args.musdb, args.cache)
    dist.barrier()

    files = sorted((args.cache / "train").glob("*.npy"))
    valid_files, train_files = files[: args.n_valid], files[args.n_valid:]
    ds = CachedRemix(train_files, args.seconds, args.items)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                    worker_init_fn=lambda w: random.seed(1000 * rank + w + torch.initial_seed() % 1000003))

    torch.manual_seed(0)
    net = MultiHeadBSRNN().to(dev)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    start = 0
    ckpt_path = args.out / "last.pt"
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=dev)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    run = None
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project="mss-bsrnn", config=vars(args), resume="allow", id=os.environ.get("WANDB_RUN_ID"))

    step = start * len(dl)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for stems in dl:
            stems = stems.to(dev, non_blocking=True)
            k = step % len(TARGETS)
            est = model(stems.sum(1), TARGETS[k])
            loss = F.l1_loss(est, stems[:, k])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
            if run is not None and step % 100 == 0:
                run.log({f"train/l1_{TARGETS[k]}": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)
        sched.step()

        if (epoch + 1) % args.eval_every == 0:
            net.eval()
            tot = torch.zeros(len(TARGETS) + 1, device=dev)
            for f in valid_files[rank::world]:
                tot[:-1] += eval_track(net, np.load(f, mmap_mode="r"), dev)
                tot[-1] += 1
            dist.all_reduce(tot)
            net.train()
            sdr = tot[:-1] / tot[-1]
            if run is not None:
                run.log({f"valid/sdr_{t}": v for t, v in zip(TARGETS, sdr.tolist())} | {"valid/sdr": sdr.mean().item()},
                        step=step)

        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
