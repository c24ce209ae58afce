"""Dense local descriptor training on MegaDepth pairs (dual-softmax on depth-derived correspondences).

The pair index (covisible image pairs per scene, with overlap scores) is built once from the
scene_info files and cached next to the data.

    torchrun --nproc_per_node=8 05_dense_desc_megadepth_index.py --root /datasets/MegaDepth_v1 --run r18_dsm
"""
import argparse
import os
import pickle
import random
from dataclasses import MISSING, dataclass

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


@dataclass
class Cfg:
    root: str
    run: str
    out_dir: str = "experiments"
    img_size: int = 512
    min_overlap: float = 0.15
    max_overlap: float = 0.8
    max_pairs_per_scene: int = 300
    n_corr: int = 1024
    temperature: float = 0.05
    batch_size: int = 6
    lr: float = 3e-4
    epochs: int = 25
    workers: int = 6


def parse() -> Cfg:
    p = argparse.ArgumentParser()
    for name, field in Cfg.__dataclass_fields__.items():
        if field.default is MISSING:
            p.add_argument(f"--{name}", required=True)
        else:
            p.add_argument(f"--{name}", type=type(field.default), default=field.default)
    return Cfg(**vars(p.parse_args()))


def build_pair_index(root, min_ov, max_ov, max_pairs):
    index = []
    info_dir = os.path.join(root, "scene_info")
    for fn in tqdm(sorted(os.listdir(info_dir)), desc="indexing scenes"):
        info = np.load(os.path.join(info_dir, fn), allow_pickle=True)
        ov = info["overlap_matrix"]
        i, j = np.where((ov > min_ov) & (ov <= max_ov))
        keep = i < j
        i, j = i[keep], j[keep]
        if len(i) == 0:
            continue
        if len(i) > max_pairs:
            sel = np.random.RandomState(len(i)).choice(len(i), max_pairs, replace=False)
            i, j = i[sel], j[sel]
        for a, b in zip(i, j):
            if info["depth_paths"][a] is None or info["depth_paths"][b] is None:
                continue
            index.append({
                "im0": info["image_paths"][a], "im1": info["image_paths"][b],
                "d0": info["depth_paths"][a], "d1": info["depth_paths"][b],
                "K0": info["intrinsics"][a], "K1": info["intrinsics"][b],
                "T0": info["poses"][a], "T1": info["poses"][b], "overlap": float(ov[a, b]),
            })
    return index


def load_pair_index(cfg):
    cache = os.path.join(cfg.root, f"pair_index_{cfg.min_overlap}_{cfg.max_overlap}_{cfg.max_pairs_per_scene}.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    index = build_pair_index(cfg.root, cfg.min_overlap, cfg.max_overlap, cfg.max_pairs_per_scene)
    with open(cache, "wb") as f:
        pickle.dump(index, f)
    return index


class MegaDepthPairs(Dataset):
    def __init__(self, root, index, size, n_corr):
        self.root, self.index, self.size, self.n_corr = root, index, size, n_corr

    def __len__(self):
        return len(self.index)

    def _load(self, img_rel, depth_rel, K):
        img = cv2.imread(os.path.join(self.root, img_rel), cv2.IMREAD_COLOR)[..., ::-1]
        with h5py.File(os.path.join(self.root, depth_rel), "r") as f:
            depth = f["depth"][()].astype(np.float32)
        h, w = img.shape[:2]
        img = cv2.resize(img, (self.size, self.size), interpolation=cv2.INTER_AREA)
        depth = cv2.resize(depth, (self.size, self.size), interpolation=cv2.INTER_NEAREST)
        K = K.copy().astype(np.float64)
        K[0] *= self.size / w
        K[1] *= self.size / h
        return img, depth, K

    def _correspondences(self, d0, d1, K0, K1, T_0to1):
        ys, xs = np.nonzero(d0 > 0)
        if len(xs) == 0:
            return np.zeros((0, 4), np.float32)
        sel = np.random.choice(len(xs), min(len(xs), 8 * self.n_corr), replace=False)
        xs, ys = xs[sel], ys[sel]
        z = d0[ys, xs]
        pts = np.linalg.inv(K0) @ np.stack([xs * z, ys * z, z])
        pts = T_0to1[:3, :3] @ pts + T_0to1[:3, 3:]
        uv = K1 @ pts
        u, v = uv[0] / uv[2], uv[1] / uv[2]
        ok = (uv[2] > 0) & (u >= 0) & (u < self.size - 1) & (v >= 0) & (v < self.size - 1)
        ui, vi = u[ok].astype(int), v[ok].astype(int)
        z1 = d1[vi, ui]
        cons = (z1 > 0) & (np.abs(z1 - pts[2][ok]) / np.maximum(z1, 1e-6) < 0.05)
        c = np.stack([xs[ok][cons], ys[ok][cons], u[ok][cons], v[ok][cons]], 1).astype(np.float32)
        return c[: self.n_corr]

    def __getitem__(self, i):
        e = self.index[i]
        im0, d0, K0 = self._load(e["im0"], e["d0"], e["K0"])
        im1, d1, K1 = self._load(e["im1"], e["d1"], e["K1"])
        T_0to1 = e["T1"] @ np.linalg.inv(e["T0"])
        corr = self._correspondences(d0, d1, K0, K1, T_0to1)
        pad = np.full((self.n_corr, 4), -1, np.float32)
        pad[: len(corr)] = corr
        to_t = lambda im: torch.from_numpy(np.ascontiguousarray(im)).permute(2, 0, 1).float() / 255.0
        return to_t(im0), to_t(im1), torch.from_numpy(pad), len(corr)


class DescNet(nn.Module):
    def __init__(self, dim=128):
        super().__init__()

        def block(cin, cout, stride):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.b1, self.b2, self.b3, self.b4 = block(3, 32, 1), block(32, 64, 2), block(64, 128, 2), block(128, 128, 2)
        self.head = nn.Conv2d(32 + 64 + 128 + 128, dim, 1)

    def forward(self, x):
        mean = x.new_tensor([0.485, 0.456, 0.406])[:, None, None]
        std = x.new_tensor([0.229, 0.224, 0.225])[:, None, None]
        x1 = self.b1((x - mean) / std)
        x2 = self.b2(x1)
        x3 = self.b3(x2)
        x4 = self.b4(x3)
        size = x2.shape[-2:]
        up = lambda t: F.interpolate(t, size=size, mode="bilinear", align_corners=False)
        f = torch.cat([F.avg_pool2d(x1, 2), x2, up(x3), up(x4)], 1)
        return F.normalize(self.head(f), dim=1)  # stride 2


def sample_desc(fmap, pts, img_size):
    grid = pts / (img_size - 1) * 2 - 1
    return F.normalize(F.grid_sample(fmap, grid[:, None], align_corners=True)[:, :, 0].transpose(1, 2), dim=-1)


def dual_softmax_loss(f0, f1, corr, n_valid, img_size, temp):
    d0 = sample_desc(f0, corr[..., :2], img_size)
    d1 = sample_desc(f1, corr[..., 2:], img_size)
    losses, accs = [], []
    for b in range(d0.size(0)):
        n = int(n_valid[b])
        if n < 8:
            losses.append(d0[b].sum() * 0.0)
            continue
        sim = d0[b, :n] @ d1[b, :n].T / temp
        tgt = torch.arange(n, device=sim.device)
        losses.append(0.5 * (F.cross_entropy(sim, tgt) + F.cross_entropy(sim.T, tgt)))
        accs.append((sim.argmax(1) == tgt).float().mean())
    acc = torch.stack(accs).mean() if accs else f0.new_zeros(())
    return torch.stack(losses).mean(), acc


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    index = load_pair_index(cfg)
    ds = MegaDepthPairs(cfg.root, index, cfg.img_size, cfg.n_corr)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                    pin_memory=True, drop_last=True,
                    worker_init_fn=lambda wid: np.random.seed((torch.initial_seed() + wid) % 2 ** 32))

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DescNet()).to(dev)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=1e-4)
    total = cfg.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total, pct_start=0.05)

    out = os.path.join(cfg.out_dir, cfg.run)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        print(f"{len(index)} pairs, {len(dl)} it/epoch on each of {world} GPUs")

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        net.train()
        meter = torch.zeros(3, device=dev)
        for im0, im1, corr, n in dl:
            im0, im1, corr = im0.to(dev, non_blocking=True), im1.to(dev, non_blocking=True), corr.to(dev)
            f = net(torch.cat([im0, im1]))
            f0, f1 = f.chunk(2)
            loss, acc = dual_softmax_loss(f0, f1, corr, n, cfg.img_size, cfg.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=dev)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch}: loss {meter[0] / meter[2]:.4f}  top1 {meter[1] / meter[2]:.3f}")
            torch.save({"net": net.module.state_dict(), "epoch": epoch, "cfg": vars(cfg)},
                       os.path.join(out, f"epoch_{epoch:03d}.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
