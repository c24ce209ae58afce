"""Multi-GPU tiled prediction of membrane / organelle probability maps for whole tomograms.

Tiles are cut with overlap and blended with a Gaussian weight map.  Tiles are dealt
round-robin to the ranks; every rank accumulates its own (weighted prediction, weight)
pair and writes it to the output folder, and rank 0 sums the partial results and
writes the final MRC.

    torchrun --nproc_per_node=4 03_predict_tomo_tiled.py \
        --ckpt /nfs/cryoet/models/memseg_v7/best.pt \
        --tomo /nfs/cryoet/tomos/TS_031_bin4.mrc --out /nfs/cryoet/pred/TS_031_memseg.mrc
"""
import argparse
import datetime
import itertools
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tomo", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tile", type=int, default=160)
    p.add_argument("--overlap", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sigma", type=float, default=0.125)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--keep-parts", action="store_true")
    return p.parse_args()


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv3d(c, c, 3, padding=1)
        self.n1 = nn.GroupNorm(8, c)
        self.c2 = nn.Conv3d(c, c, 3, padding=1)
        self.n2 = nn.GroupNorm(8, c)

    def forward(self, x):
        y = F.silu(self.n1(self.c1(x)))
        return F.silu(x + self.n2(self.c2(y)))


class MemSegNet(nn.Module):
    def __init__(self, in_ch=1, out_ch=1, ch=(32, 64, 128, 256)):
        super().__init__()
        self.stem = nn.Conv3d(in_ch, ch[0], 3, padding=1)
        self.enc = nn.ModuleList([ResBlock(c) for c in ch])
        self.down = nn.ModuleList([nn.Conv3d(ch[i], ch[i + 1], 2, stride=2) for i in range(len(ch) - 1)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(ch[i + 1], ch[i], 2, stride=2)
                                 for i in reversed(range(len(ch) - 1))])
        self.dec = nn.ModuleList([ResBlock(ch[i]) for i in reversed(range(len(ch) - 1))])
        self.head = nn.Conv3d(ch[0], out_ch, 1)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x)
        for up, dec in zip(self.up, self.dec):
            x = dec(up(x) + skips.pop())
        return self.head(x)


def gaussian_weight(size, sigma_scale):
    c = (size - 1) / 2.0
    ax = np.arange(size) - c
    g = np.exp(-(ax ** 2) / (2 * (sigma_scale * size) ** 2))
    w = g[:, None, None] * g[None, :, None] * g[None, None, :]
    w = w / w.max()
    return np.maximum(w, 1e-3).astype(np.float32)


def tile_origins(shape, tile, overlap):
    step = max(1, int(round(tile * (1 - overlap))))
    axes = []
    for s in shape:
        if s <= tile:
            axes.append([0])
            continue
        starts = list(range(0, s - tile + 1, step))
        if starts[-1] != s - tile:
            starts.append(s - tile)
        axes.append(starts)
    return list(itertools.product(*axes))


def load_model(path, device):
    ckpt = torch.load(path, map_location="cpu")
    state = ckpt.get("model", ckpt)
    # checkpoints from the training script may carry the DDP prefix
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    cfg = ckpt.get("model_cfg", {})
    model = MemSegNet(**cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    # rank 0 stitches everything at the end, give the others time to wait for it
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with mrcfile.mmap(args.tomo, mode="r", permissive=True) as m:
        vol = np.asarray(m.data, dtype=np.float32)
        voxel_size = m.voxel_size.copy()
    mu, sd = float(vol.mean()), float(vol.std()) + 1e-6

    pad = [(0, max(0, args.tile - s)) for s in vol.shape]
    vol_p = np.pad(vol, pad, mode="reflect") if any(p[1] for p in pad) else vol
    shape = vol_p.shape

    origins = tile_origins(shape, args.tile, args.overlap)
    mine = origins[rank::world]
    if rank == 0:
        print(f"volume {vol.shape}, {len(origins)} tiles over {world} GPUs", flush=True)

    model = load_model(args.ckpt, device)
    w_np = gaussian_weight(args.tile, args.sigma)
    weight = torch.from_numpy(w_np).to(device)
    acc = np.zeros(shape, dtype=np.float32)
    wsum = np.zeros(shape, dtype=np.float32)
    t = args.tile

    t0 = time.time()
    with torch.inference_mode():
        for b in range(0, len(mine), args.batch):
            batch_origins = mine[b:b + args.batch]
            tiles = np.stack([vol_p[z:z + t, y:y + t, x:x + t] for z, y, x in batch_origins])
            x_in = torch.from_numpy((tiles - mu) / sd).unsqueeze(1).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                logits = model(x_in)
            prob = torch.sigmoid(logits.float())[:, 0] * weight
            prob = prob.cpu().numpy()
            for (z, y, x), pr in zip(batch_origins, prob):
                acc[z:z + t, y:y + t, x:x + t] += pr
                wsum[z:z + t, y:y + t, x:x + t] += w_np
    print(f"[rank {rank}] {len(mine)} tiles in {time.time() - t0:.1f}s", flush=True)

    part = f"{args.out}.part{rank:02d}.npz"
    np.savez(part, acc=acc, wsum=wsum)
    dist.barrier(device_ids=[local_rank])

    if rank == 0:
        total = np.zeros(shape, dtype=np.float32)
        wtotal = np.zeros(shape, dtype=np.float32)
        for r in range(world):
            f = f"{args.out}.part{r:02d}.npz"
            with np.load(f) as d:
                total += d["acc"]
                wtotal += d["wsum"]
            if not args.keep_parts:
                os.remove(f)
        out = total / np.maximum(wtotal, 1e-6)
        out = out[: vol.shape[0], : vol.shape[1], : vol.shape[2]]
        with mrcfile.new(args.out, overwrite=True) as m:
            m.set_data(out.astype(np.float32))
            m.voxel_size = voxel_size
        print(f"wrote {args.out}", flush=True)

    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
