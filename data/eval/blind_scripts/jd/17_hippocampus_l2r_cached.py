"""
Learn2Reg 2020 Task 4 (hippocampus MR, 64^3 crops): inter-subject registration with
label supervision (anterior / posterior hippocampus) + NCC.

The NIfTI volumes are padded/cropped to 64^3 and intensity-normalised once and stored as a
single .npz cache next to the data (rank 0 builds it, the other ranks wait and read it).

    torchrun --nproc_per_node=4 17_hippocampus_l2r_cached.py --root /data/L2R_Task4 --wandb
"""
import argparse
import glob
import os
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SIZE = 64


def fit(vol, size=SIZE):
    out = np.zeros((size,) * 3, vol.dtype)
    src = [slice(max((s - size) // 2, 0), max((s - size) // 2, 0) + min(s, size)) for s in vol.shape]
    dst = [slice(max((size - s) // 2, 0), max((size - s) // 2, 0) + min(s, size)) for s in vol.shape]
    out[tuple(dst)] = vol[tuple(src)]
    return out


def build_cache(root, cache_path):
    imgs, segs, names = [], [], []
    for p in sorted(glob.glob(os.path.join(root, "Training", "img", "*.nii.gz"))):
        v = nib.load(p).get_fdata(dtype=np.float32)
        lo, hi = np.percentile(v, (0.5, 99.5))
        imgs.append(fit(np.clip((v - lo) / (hi - lo), 0, 1)))
        segs.append(fit(np.asarray(nib.load(p.replace("/img/", "/label/")).dataobj, np.uint8)))
        names.append(os.path.basename(p))
    tmp = cache_path + ".tmp.npz"
    np.savez_compressed(tmp, img=np.stack(imgs), seg=np.stack(segs), names=np.array(names))
    os.replace(tmp, cache_path)


class HippoPairs(Dataset):
    def __init__(self, img, seg, idx, pairs_per_subject=4, seed=0):
        self.img, self.seg = img, seg
        rng = np.random.default_rng(seed)
        self.pairs = [(i, j) for i in idx for j in rng.choice([k for k in idx if k != i], pairs_per_subject, replace=False)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, n):
        i, j = self.pairs[n]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None]
        return t(self.img[i]), t(self.img[j]), t(self.seg[i].astype(np.int64)), t(self.seg[j].astype(np.int64)), n


class Net(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        blk = lambda i, o, s=1: nn.Sequential(nn.Conv3d(i, o, 3, s, 1), nn.LeakyReLU(0.2))
        self.e = nn.ModuleList([blk(2, c), blk(c, c, 2), blk(c, 2 * c, 2), blk(2 * c, 2 * c, 2)])
        self.d = nn.ModuleList([blk(4 * c, 2 * c), blk(3 * c, c), blk(2 * c, c)])
        self.flow = nn.Conv3d(c, 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0, 1e-5)
        nn.init.zeros_(self.flow.bias)
        grid = torch.stack(torch.meshgrid([torch.arange(SIZE)] * 3, indexing="ij"))[None].float()
        self.register_buffer("grid", grid, persistent=False)

    def transform(self, x, flow, mode="bilinear"):
        loc = self.grid + flow
        loc = torch.stack([2 * loc[:, i] / (SIZE - 1) - 1 for i in range(3)], -1)[..., [2, 1, 0]]
        return F.grid_sample(x, loc, mode=mode, padding_mode="border", align_corners=True)

    def forward(self, m, f):
        x = torch.cat([m, f], 1)
        sk = []
        for e in self.e:
            x = e(x)
            sk.append(x)
        for d, s in zip(self.d, sk[-2::-1]):
            x = d(torch.cat([F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False), s], 1))
        return self.flow(x)


def soft_dice(a, b):
    inter = (a * b).sum((2, 3, 4))
    return 1 - (2 * inter / (a.sum((2, 3, 4)) + b.sum((2, 3, 4)) + 1e-5))[:, 1:].mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/hippo")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--bs", type=int, default=8, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-4, help="for a global batch of 8")
    ap.add_argument("--w-seg", type=float, default=1.0)
    ap.add_argument("--w-reg", type=float, default=0.5)
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    cache = os.path.join(args.root, f"cache_{SIZE}.npz")
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.root, cache)
    dist.barrier()
    data = np.load(cache)
    img, seg = data["img"], data["seg"]
    n = len(img)
    val_idx, train_idx = list(range(0, n, 10)), [i for i in range(n) if i % 10]
    train_ds = HippoPairs(img, seg, train_idx, 4, seed=0)
    val_ds = HippoPairs(img, seg, val_idx, 2, seed=1)
    sampler = DistributedSampler(train_ds, shuffle=True)
    vsampler = DistributedSampler(val_ds, shuffle=False)
    loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    vloader = DataLoader(val_ds, args.bs, sampler=vsampler, num_workers=2)

    # no BatchNorm and the grid never changes -> no buffer broadcast needed
    model = DDP(Net().to(dev), device_ids=[local_rank], broadcast_buffers=False)
    lr = args.base_lr * args.bs * world / 8
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5) * (1 - e / args.epochs) ** 0.9)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="l2r-hippocampus", config={**vars(args), "lr": lr, "world": world})

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=dev)
        for m, f, ms, fs, _ in loader:
            m, f, ms, fs = m.to(dev), f.to(dev), ms.to(dev), fs.to(dev)
            flow = model(m, f)
            net = model.module
            warped = net.transform(m, flow)
            ms_oh = F.one_hot(ms[:, 0], 3).permute(0, 4, 1, 2, 3).float()
            fs_oh = F.one_hot(fs[:, 0], 3).permute(0, 4, 1, 2, 3).float()
            l_seg = soft_dice(net.transform(ms_oh, flow), fs_oh)
            l_sim = F.mse_loss(warped, f)
            l_reg = sum(flow.diff(dim=d).pow(2).mean() for d in (2, 3, 4))
            loss = l_sim + args.w_seg * l_seg + args.w_reg * l_reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()
        dist.all_reduce(acc)

        # per-pair dice, gathered with the pair index so the sampler's padded duplicates are dropped
        net = model.module
        net.eval()
        local = {}
        with torch.no_grad():
            for m, f, ms, fs, idx in vloader:
                flow = net(m.to(dev), f.to(dev))
                w = net.transform(ms.to(dev).float(), flow, mode="nearest").long()
                fs = fs.to(dev)
                for b in range(w.shape[0]):
                    d = [(2 * ((w[b] == c) & (fs[b] == c)).sum() / ((w[b] == c).sum() + (fs[b] == c).sum()).clamp(min=1)).item()
                         for c in (1, 2)]
                    local[int(idx[b])] = float(np.mean(d))
        parts = [None] * world
        dist.all_gather_object(parts, local)
        merged = {k: v for p in parts for k, v in p.items()}
        val_dice = float(np.mean(list(merged.values())))

        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} val dice {val_dice:.4f} "
                  f"({len(merged)} pairs, {time.time() - t0:.0f}s)", flush=True)
            if run is not None:
                run.log({"loss": (acc[0] / acc[1]).item(), "val_dice": val_dice, "lr": sched.get_last_lr()[0]}, step=epoch)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()}, os.path.join(args.out, "last.pt"))
            if val_dice > best:
                best = val_dice
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
