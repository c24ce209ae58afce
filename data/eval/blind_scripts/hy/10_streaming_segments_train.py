"""Wave-U-Net singing voice separation trained on the long-form karaoke corpus.

The corpus is ~2k recordings of 3 to 70 minutes each (vocals.flac + accompaniment.flac per
folder), far too long to index per segment, so the files are streamed: each GPU reads its
own share of the recordings front to back and cuts them into consecutive segments.

    torchrun --nproc_per_node=8 10_streaming_segments_train.py --corpus /data/karaoke_long --out exp/waveunet
"""
import argparse
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class StreamingKaraoke(IterableDataset):
    def __init__(self, folders, segment, rank, world, seed=0, block_segments=64):
        super().__init__()
        self.folders = list(folders)
        self.segment = segment
        self.rank, self.world = rank, world
        self.seed = seed
        self.epoch = 0
        self.block = block_segments

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        folders = self.folders[self.rank::self.world]
        info = get_worker_info()
        if info is not None:
            folders = folders[info.id::info.num_workers]
        rng = random.Random(self.seed + 7 * self.epoch + 131 * self.rank + (info.id if info else 0))
        rng.shuffle(folders)
        n = self.segment
        for folder in folders:
            with sf.SoundFile(str(folder / "vocals.flac")) as fv, sf.SoundFile(str(folder / "accompaniment.flac")) as fa:
                fv.seek(rng.randrange(n))
                fa.seek(fv.tell())
                while True:
                    v = fv.read(n * self.block, dtype="float32", always_2d=True)
                    a = fa.read(n * self.block, dtype="float32", always_2d=True)
                    k = min(len(v), len(a)) // n
                    if k == 0:
                        break
                    for j in rng.sample(range(k), k):
                        voc = v[j * n:(j + 1) * n].T
                        acc = a[j * n:(j + 1) * n].T
                        g_v, g_a = rng.uniform(0.5, 1.3), rng.uniform(0.5, 1.3)
                        yield torch.from_numpy(g_v * voc + g_a * acc), torch.from_numpy(g_v * voc)


class WaveUNet(nn.Module):
    def __init__(self, channels=2, layers=10, base=24, k_down=15, k_up=5):
        super().__init__()
        self.layers = layers
        self.down = nn.ModuleList()
        c_in = channels
        for i in range(layers):
            self.down.append(nn.Conv1d(c_in, base * (i + 1), k_down, padding=k_down // 2))
            c_in = base * (i + 1)
        self.mid = nn.Conv1d(c_in, base * (layers + 1), k_down, padding=k_down // 2)
        self.up = nn.ModuleList()
        c = base * (layers + 1)
        for i in reversed(range(layers)):
            self.up.append(nn.Conv1d(c + base * (i + 1), base * (i + 1), k_up, padding=k_up // 2))
            c = base * (i + 1)
        self.out = nn.Conv1d(c + channels, channels, 1)

    def forward(self, x):
        inp, skips = x, []
        for conv in self.down:
            x = F.leaky_relu(conv(x), 0.2)
            skips.append(x)
            x = x[..., ::2]
        x = F.leaky_relu(self.mid(x), 0.2)
        for conv in self.up:
            x = F.interpolate(x, scale_factor=2, mode="linear", align_corners=False)
            x = F.leaky_relu(conv(torch.cat([x, skips.pop()], dim=1)), 0.2)
        return torch.tanh(self.out(torch.cat([x, inp], dim=1)))


@torch.no_grad()
def separate_long(net, mix, segment, device, overlap=0.5):
    hop = int(segment * (1 - overlap))
    T = mix.shape[-1]
    n_chunks = max(1, math.ceil((T - segment) / hop) + 1)
    total = (n_chunks - 1) * hop + segment
    x = F.pad(mix, (0, total - T))
    win = torch.hann_window(segment, periodic=False).clamp_min(1e-2)
    out, wsum = torch.zeros_like(x), torch.zeros(total)
    for i in range(n_chunks):
        s = i * hop
        y = net(x[None, :, s:s + segment].to(device))[0].cpu()
        out[:, s:s + segment] += y * win
        wsum[s:s + segment] += win
    return (out / wsum)[:, :T]


def sdr(ref, est):
    return 10 * math.log10(float((ref ** 2).sum()) / max(float(((ref - est) ** 2).sum()), 1e-9))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--valid-list", type=Path, default=Path("lists/karaoke_valid.txt"))
    ap.add_argument("--out", type=Path, default=Path("exp/waveunet"))
    ap.add_argument("--segment", type=int, default=2 ** 17)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    valid_names = {l.strip() for l in args.valid_list.read_text().splitlines() if l.strip()}
    folders = sorted(p for p in args.corpus.iterdir() if (p / "vocals.flac").exists())
    train_folders = [p for p in folders if p.name not in valid_names]
    valid_folders = [p for p in folders if p.name in valid_names]

    dataset = StreamingKaraoke(train_folders, args.segment, rank, world, seed=1234)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True,
                        drop_last=True)

    net = WaveUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"{len(train_folders)} training recordings over {world} GPUs, {len(valid_folders)} for validation")

    global_step = 0
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for mix, voc in loader:
            mix, voc = mix.to(device, non_blocking=True), voc.to(device, non_blocking=True)
            loss = F.mse_loss(model(mix), voc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones_like(loss)])
            global_step += 1
            if rank == 0 and global_step % args.log_every == 0:
                print(f"step {global_step} loss {loss.item():.5f} {(time.time() - t0) / 60:.1f} min", flush=True)
        dist.all_reduce(run)

        net.eval()
        acc = torch.zeros(2, device=device)
        for folder in valid_folders[rank::world]:
            voc, _ = sf.read(str(folder / "vocals.flac"), dtype="float32", always_2d=True)
            accm, _ = sf.read(str(folder / "accompaniment.flac"), dtype="float32", always_2d=True)
            n = min(len(voc), len(accm))
            voc, accm = voc[:n].T, accm[:n].T
            est = separate_long(net, torch.from_numpy(voc + accm), args.segment, device).numpy()
            acc[0] += sdr(voc, est)
            acc[1] += 1
        dist.all_reduce(acc)
        net.train()

        if rank == 0:
            print(f"epoch {epoch}: train mse {(run[0] / run[1]).item():.5f}, "
                  f"valid vocals SDR {(acc[0] / acc[1]).item():.2f} dB", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "step": global_step}, args.out / f"waveunet_{epoch:02d}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
