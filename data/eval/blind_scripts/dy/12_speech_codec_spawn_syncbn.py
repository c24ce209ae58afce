"""Low-bitrate 16 kHz speech codec for on-device use (BN encoder, RVQ, light decoder).

Runs on a single 4-8 GPU workstation, so it spawns its own workers instead of going
through torchrun:

    python 12_speech_codec_spawn_syncbn.py --wav-list lists/speech_16k.txt --cache /scratch/codec_cache \
        --out runs/speech_codec_1k5
"""
import argparse
import datetime
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--wav-list", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--crop-seconds", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


# ---------------------------------------------------------------- cache (built once, by rank 0)
def build_cache(wav_list, cache_dir):
    """Resample everything to 16 kHz mono and pack it in one raw float16 file + an offsets index."""
    os.makedirs(cache_dir, exist_ok=True)
    with open(wav_list) as f:
        paths = [l.strip() for l in f if l.strip()]
    index, pos = [], 0
    tmp = os.path.join(cache_dir, "audio.f16.tmp")
    with open(tmp, "wb") as out:
        for p in paths:
            wav, sr = torchaudio.load(p)
            wav = torchaudio.functional.resample(wav.mean(0), sr, SR).numpy().astype(np.float16)
            out.write(wav.tobytes())
            index.append((pos, len(wav)))
            pos += len(wav)
    os.replace(tmp, os.path.join(cache_dir, "audio.f16"))
    with open(os.path.join(cache_dir, "index.json.tmp"), "w") as f:
        json.dump(index, f)
    os.replace(os.path.join(cache_dir, "index.json.tmp"), os.path.join(cache_dir, "index.json"))


class PackedCrops(Dataset):
    def __init__(self, cache_dir, crop, split="train", valid_every=100):
        with open(os.path.join(cache_dir, "index.json")) as f:
            index = json.load(f)
        keep = (lambda i: i % valid_every != 0) if split == "train" else (lambda i: i % valid_every == 0)
        self.index = [(s, n) for i, (s, n) in enumerate(index) if keep(i) and n >= crop]
        self.path, self.crop, self.train = os.path.join(cache_dir, "audio.f16"), crop, split == "train"
        self.data = None  # opened lazily in each worker

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if self.data is None:
            self.data = np.memmap(self.path, dtype=np.float16, mode="r")
        start, n = self.index[i]
        off = random.randint(0, n - self.crop) if self.train else 0
        return torch.from_numpy(self.data[start + off : start + off + self.crop].astype(np.float32))[None]


# ---------------------------------------------------------------- model
class ConvBN(nn.Sequential):
    def __init__(self, cin, cout, k, stride=1):
        super().__init__(nn.Conv1d(cin, cout, k, stride, padding=(k - stride + 1) // 2, bias=False),
                         nn.BatchNorm1d(cout), nn.GELU())


class SpeechCodec(nn.Module):
    def __init__(self, dim=256, n_q=6, bins=1024, strides=(2, 4, 5, 8)):
        super().__init__()
        ch, enc = 32, [ConvBN(1, 32, 7)]
        for s in strides:
            enc += [ConvBN(ch, ch, 3), ConvBN(ch, ch * 2, 2 * s, stride=s)]
            ch *= 2
        enc.append(nn.Conv1d(ch, dim, 1))
        self.encoder = nn.Sequential(*enc)
        self.codebooks = nn.ParameterList(nn.Parameter(torch.randn(bins, dim) * 0.01) for _ in range(n_q))
        dec = [nn.Conv1d(dim, ch, 7, padding=3)]
        for s in reversed(strides):
            dec += [nn.GELU(), nn.ConvTranspose1d(ch, ch // 2, 2 * s, stride=s, padding=s // 2),
                    nn.GELU(), nn.Conv1d(ch // 2, ch // 2, 7, padding=3)]
            ch //= 2
        dec += [nn.GELU(), nn.Conv1d(ch, 1, 7, padding=3)]
        self.decoder = nn.Sequential(*dec)

    def quantize(self, z):
        res, out, loss = z, torch.zeros_like(z), 0.0
        for cb in self.codebooks:
            flat = res.transpose(1, 2)
            idx = torch.cdist(flat, cb[None].expand(flat.shape[0], -1, -1)).argmin(-1)
            q = F.embedding(idx, cb).transpose(1, 2)
            loss = loss + F.mse_loss(q, res.detach()) + 0.25 * F.mse_loss(res, q.detach())
            q = res + (q - res).detach()
            out, res = out + q, res - q.detach()
        return out, loss / len(self.codebooks)

    def forward(self, x):
        zq, vq = self.quantize(self.encoder(x))
        return self.decoder(zq)[..., : x.shape[-1]], vq


def stft_loss(x, y):
    loss = 0.0
    for n in (256, 512, 1024):
        w = torch.hann_window(n, device=x.device)
        sx = torch.stft(x.squeeze(1), n, n // 4, window=w, return_complex=True).abs() + 1e-6
        sy = torch.stft(y.squeeze(1), n, n // 4, window=w, return_complex=True).abs() + 1e-6
        loss = loss + (sx - sy).norm() / sy.norm() + F.l1_loss(sx.log(), sy.log())
    return loss / 3


# ---------------------------------------------------------------- worker
def worker(local_rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(local_rank)
    # long timeout: rank 0 may spend a while building the cache before the first barrier
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size, timeout=datetime.timedelta(hours=3))
    device = torch.device("cuda", local_rank)
    rank = local_rank
    random.seed(rank)
    torch.manual_seed(0)

    if rank == 0 and not os.path.exists(os.path.join(args.cache, "index.json")):
        print("building audio cache ...", flush=True)
        build_cache(args.wav_list, args.cache)
    dist.barrier()

    crop = int(args.crop_seconds * SR) // 320 * 320
    train_set, valid_set = PackedCrops(args.cache, crop), PackedCrops(args.cache, crop, split="valid")
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size // world_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    valid_sampler = DistributedSampler(valid_set, world_size, rank, shuffle=False, drop_last=True)
    valid_loader = DataLoader(valid_set, 16, sampler=valid_sampler, num_workers=2)

    model = SpeechCodec()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.8, 0.99), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="speech-codec", config=vars(args), dir=args.out)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            y, vq = model(x)
            loss = stft_loss(y, x) + F.l1_loss(y, x) + vq
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if i % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0]})

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x in valid_loader:
                x = x.to(device)
                y, _ = model(x)
                stats[0] += stft_loss(y, x) * x.shape[0]
                stats[1] += x.shape[0]
        dist.all_reduce(stats)
        val = (stats[0] / stats[1]).item()

        if rank == 0:
            print(f"epoch {epoch} valid_stft {val:.4f}", flush=True)
            if run is not None:
                run.log({"valid/stft": val, "epoch": epoch})
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val < best:
                best = val
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
