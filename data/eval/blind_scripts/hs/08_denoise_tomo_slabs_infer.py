"""Apply a trained 2D Noise2Noise / Noise2Void denoiser slice by slice to tomograms.

The z range of each tomogram is split into contiguous slabs, one per GPU; every slice
is predicted in overlapping XY tiles to bound activation memory, then the
slabs are gathered on rank 0 and written as MRC with the original header.

    torchrun --nproc_per_node=4 08_denoise_tomo_slabs_infer.py --model runs/n2n_tomo2d/best.pt \
        --input /data/cryoet/recon/*.mrc --outdir /data/cryoet/denoised
"""
import argparse
import glob
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
    p.add_argument("--model", required=True)
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--outdir", required=True)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--overlap", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--suffix", default="_n2n")
    p.add_argument("--half", action="store_true")
    return p.parse_args()


class Conv(nn.Sequential):
    def __init__(self, i, o):
        super().__init__(nn.Conv2d(i, o, 3, padding=1), nn.LeakyReLU(0.1, inplace=True))


class N2NUNet(nn.Module):
    """Lehtinen et al. 2018 architecture."""

    def __init__(self, ch=48):
        super().__init__()
        self.enc0 = nn.Sequential(Conv(1, ch), Conv(ch, ch))
        self.enc = nn.ModuleList([Conv(ch, ch) for _ in range(5)])
        self.dec5 = nn.Sequential(Conv(2 * ch, 2 * ch), Conv(2 * ch, 2 * ch))
        self.dec = nn.ModuleList([nn.Sequential(Conv(3 * ch, 2 * ch), Conv(2 * ch, 2 * ch)) for _ in range(3)])
        self.dec1 = nn.Sequential(Conv(2 * ch + 1, 64), Conv(64, 32), nn.Conv2d(32, 1, 3, padding=1))

    def forward(self, x):
        skips = [x]
        h = self.enc0(x)
        for i, e in enumerate(self.enc):
            h = F.max_pool2d(h, 2)
            if i < 4:
                skips.append(h)
            h = e(h)
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = self.dec5(torch.cat([h, skips.pop()], 1))
        for d in self.dec:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = d(torch.cat([h, skips.pop()], 1))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.dec1(torch.cat([h, skips.pop()], 1))


def tiles_1d(n, tile, overlap):
    if n <= tile:
        return [0]
    step = tile - overlap
    starts = list(range(0, n - tile, step)) + [n - tile]
    return starts


def denoise_slice(model, sl, tile, overlap, batch, device, half):
    h, w = sl.shape
    th, tw = min(tile, h), min(tile, w)
    ph, pw = (-th) % 32, (-tw) % 32
    out = torch.zeros((h, w), device=device)
    cnt = torch.zeros((h, w), device=device)
    coords = [(y, x) for y in tiles_1d(h, th, overlap) for x in tiles_1d(w, tw, overlap)]
    src = torch.from_numpy(sl).to(device)
    m = overlap // 4  # discard the outermost pixels of each tile except at the border
    for b in range(0, len(coords), batch):
        cb = coords[b:b + batch]
        x = torch.stack([src[y:y + th, x0:x0 + tw] for y, x0 in cb])[:, None]
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
        with torch.autocast("cuda", dtype=torch.float16, enabled=half):
            y_hat = model(x)[:, 0, :th, :tw].float()
        for (y, x0), t in zip(cb, y_hat):
            y0 = 0 if y == 0 else m
            x1 = 0 if x0 == 0 else m
            out[y + y0:y + th, x0 + x1:x0 + tw] += t[y0:, x1:]
            cnt[y + y0:y + th, x0 + x1:x0 + tw] += 1
    return out / cnt.clamp(min=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    ck = torch.load(args.model, map_location="cpu")
    model = N2NUNet()
    model.load_state_dict(ck["state_dict"])
    model.to(device).eval()
    norm = ck.get("norm", {"mean": 0.0, "std": 1.0})

    files = sorted(f for pat in args.input for f in glob.glob(pat))
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        print(f"{len(files)} tomograms, {world} GPUs", flush=True)

    for f in files:
        t0 = time.time()
        with mrcfile.mmap(f, mode="r", permissive=True) as m:
            nz = m.data.shape[0]
            bounds = np.linspace(0, nz, world + 1).astype(int)
            z0, z1 = bounds[rank], bounds[rank + 1]
            slab = np.asarray(m.data[z0:z1], dtype=np.float32)
            voxel_size = m.voxel_size.copy()
            # same normalisation on every rank: statistics of a strided subsample of the whole volume
            sub = np.asarray(m.data[::4, ::8, ::8], dtype=np.float32)
        mu = float(sub.mean())
        sd = float(sub.std()) + 1e-6

        res = torch.empty((z1 - z0,) + slab.shape[1:], device=device)
        with torch.inference_mode():
            for k in range(slab.shape[0]):
                sl = ((slab[k] - mu) / sd - norm["mean"]) / norm["std"]
                res[k] = denoise_slice(model, sl.astype(np.float32), args.tile, args.overlap,
                                       args.batch, device, args.half) * norm["std"] + norm["mean"]
        res = res * sd + mu

        gathered = [torch.empty_like(res) for _ in range(world)]
        dist.all_gather(gathered, res)
        if rank == 0:
            vol = torch.cat(gathered, 0).cpu().numpy()
            name = os.path.splitext(os.path.basename(f))[0] + args.suffix + ".mrc"
            with mrcfile.new(os.path.join(args.outdir, name), overwrite=True) as out:
                out.set_data(vol.astype(np.float32))
                out.voxel_size = voxel_size
            print(f"{name}: {nz} slices in {time.time() - t0:.0f}s", flush=True)
        del gathered, res

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
