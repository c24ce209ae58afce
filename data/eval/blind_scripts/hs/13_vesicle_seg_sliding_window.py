"""Synaptic vesicle segmentation in cryo-electron tomograms of synaptosomes.

The model knows how to predict a whole tomogram with overlapping windows
(``VesicleUNet.predict_volume``); the same method is used by the inference CLI, and here
for validation on held-out tomograms, which are spread over the ranks.

    torchrun --nproc_per_node=4 13_vesicle_seg_sliding_window.py --config cfg/vesicles_bin2.yaml
"""
import argparse
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = a.resume
    return cfg


def read(path):
    with mrcfile.open(path, permissive=True) as m:
        return np.asarray(m.data, dtype=np.float32)


class TomoPatchSet(Dataset):
    def __init__(self, pairs, patch, per_tomo):
        self.vols = []
        for raw_p, lab_p in pairs:
            v = read(raw_p)
            self.vols.append(((v - v.mean()) / (v.std() + 1e-6), read(lab_p) > 0))
        self.patch, self.per_tomo = patch, per_tomo

    def __len__(self):
        return len(self.vols) * self.per_tomo

    def __getitem__(self, idx):
        v, l = self.vols[idx // self.per_tomo]
        p = self.patch
        z, y, x = (np.random.randint(0, s - p + 1) for s in v.shape)
        a, b = v[z:z + p, y:y + p, x:x + p], l[z:z + p, y:y + p, x:x + p]
        if np.random.rand() < 0.5:
            a, b = a[:, ::-1], b[:, ::-1]
        if np.random.rand() < 0.5:
            a, b = a[:, :, ::-1], b[:, :, ::-1]
        return torch.from_numpy(a.copy())[None], torch.from_numpy(b.astype(np.float32))[None]


def double_conv(i, o):
    return nn.Sequential(nn.Conv3d(i, o, 3, padding=1, bias=False), nn.InstanceNorm3d(o, affine=True),
                         nn.ReLU(inplace=True), nn.Conv3d(o, o, 3, padding=1, bias=False),
                         nn.InstanceNorm3d(o, affine=True), nn.ReLU(inplace=True))


class VesicleUNet(nn.Module):
    def __init__(self, base=16, depth=4):
        super().__init__()
        ch = [base * 2 ** i for i in range(depth)]
        self.downs = nn.ModuleList([double_conv(1 if i == 0 else ch[i - 1], ch[i]) for i in range(depth)])
        self.ups = nn.ModuleList([nn.ConvTranspose3d(ch[i], ch[i - 1], 2, 2) for i in range(depth - 1, 0, -1)])
        self.decs = nn.ModuleList([double_conv(2 * ch[i - 1], ch[i - 1]) for i in range(depth - 1, 0, -1)])
        self.head = nn.Conv3d(ch[0], 1, 1)
        self.depth = depth

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.downs):
            x = d(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.ups, self.decs):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)

    @torch.no_grad()
    def predict_volume(self, vol, window=128, overlap=32, batch=4):
        """Sliding-window prediction of a full (normalised) tomogram, returns probabilities."""
        dev = next(self.parameters()).device
        Z, Y, X = vol.shape
        step = window - overlap
        starts = [[*range(0, max(s - window, 0) + 1, step)] for s in (Z, Y, X)]
        for st, s in zip(starts, (Z, Y, X)):
            if st[-1] + window < s:
                st.append(s - window)
        out = torch.zeros((Z, Y, X), device=dev)
        cnt = torch.zeros((Z, Y, X), device=dev)
        src = torch.from_numpy(vol).to(dev)
        coords = [(z, y, x) for z in starts[0] for y in starts[1] for x in starts[2]]
        for i in range(0, len(coords), batch):
            cb = coords[i:i + batch]
            tiles = torch.stack([src[z:z + window, y:y + window, x:x + window] for z, y, x in cb])[:, None]
            prob = torch.sigmoid(self(tiles))[:, 0]
            for (z, y, x), p in zip(cb, prob):
                out[z:z + window, y:y + window, x:x + window] += p
                cnt[z:z + window, y:y + window, x:x + window] += 1
        return (out / cnt.clamp(min=1)).cpu().numpy()


def dice_loss(logits, t):
    p = torch.sigmoid(logits)
    return 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)


def evaluate(net, tomos, window):
    """tomos: list of (normalised volume, mask); returns summed (intersection, |pred|+|gt|)."""
    inter = denom = 0.0
    for vol, mask in tomos:
        pred = net.predict_volume(vol, window=window) > 0.5
        inter += float((pred & mask).sum())
        denom += float(pred.sum() + mask.sum())
    return inter, denom


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_pairs = [(t["raw"], t["label"]) for t in cfg["train"]]
    val_pairs = [(t["raw"], t["label"]) for t in cfg["val"]][rank::world]
    ds = TomoPatchSet(train_pairs, cfg["patch"], cfg["patches_per_tomo"])
    val_tomos = [(v, l) for v, l in TomoPatchSet(val_pairs, cfg["patch"], 1).vols]
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg.get("workers", 6),
                    pin_memory=True, drop_last=True)

    model = VesicleUNet(base=cfg.get("base", 16)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50)
    start = 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{len(ds)} patches/epoch, {len(cfg['val'])} val tomograms, {world} ranks", flush=True)

    best = 0.0
    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y) + dice_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(tot)

        if (epoch + 1) % cfg.get("val_every", 5) == 0:
            model.eval()
            inter, denom = evaluate(model, val_tomos, cfg["patch"])
            model.train()
            stats = torch.tensor([inter, denom], device=device, dtype=torch.float64)
            dist.all_reduce(stats)
            dice = (2 * stats[0] / stats[1].clamp(min=1)).item()
            if rank == 0:
                print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} val dice {dice:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "dice": dice}
                torch.save(ck, os.path.join(out_dir, "last.pt"))
                if dice > best:
                    best = dice
                    torch.save(ck, os.path.join(out_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
