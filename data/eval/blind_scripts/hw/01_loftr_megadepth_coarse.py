"""Coarse-level LoFTR training on MegaDepth (stage 1, no fine refinement).

    torchrun --nproc_per_node=8 01_loftr_megadepth_coarse.py \
        --data_root /data/megadepth --out runs/loftr_coarse_ds
"""
import argparse
import logging
import math
import os
import time

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("loftr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--train_list", default="assets/megadepth/train_scenes.txt")
    p.add_argument("--val_list", default="assets/megadepth/val_scenes.txt")
    p.add_argument("--out", default="runs/loftr_coarse")
    p.add_argument("--img_size", type=int, default=640)
    p.add_argument("--batch_size", type=int, default=1, help="pairs per GPU")
    p.add_argument("--canonical_bs", type=int, default=64)
    p.add_argument("--canonical_lr", type=float, default=6e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--warmup_steps", type=int, default=4800)
    p.add_argument("--pairs_per_scene", type=int, default=100)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--match_thr", type=float, default=0.2)
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class MegaDepthScene(Dataset):
    def __init__(self, root, npz_path, img_size, n_pairs=None, min_overlap=0.1, max_overlap=0.7, seed=66):
        info = np.load(npz_path, allow_pickle=True)
        self.root, self.img_size = root, img_size
        self.image_paths = info["image_paths"]
        self.depth_paths = info["depth_paths"]
        self.intrinsics = info["intrinsics"]
        self.poses = info["poses"]
        pairs = [pi[0] for pi in info["pair_infos"] if min_overlap < pi[1] < max_overlap]
        if n_pairs is not None and len(pairs) > n_pairs:
            sel = np.random.RandomState(seed).choice(len(pairs), n_pairs, replace=False)
            pairs = [pairs[i] for i in sel]
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def _load(self, idx):
        img = cv2.imread(os.path.join(self.root, self.image_paths[idx]), cv2.IMREAD_GRAYSCALE)
        h, w = img.shape
        s = self.img_size / max(h, w)
        nw, nh = int(round(w * s)) // 8 * 8, int(round(h * s)) // 8 * 8
        img = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_AREA)
        with h5py.File(os.path.join(self.root, self.depth_paths[idx]), "r") as f:
            depth = np.array(f["depth"], dtype=np.float32)
        depth = cv2.resize(depth, (nw, nh), interpolation=cv2.INTER_NEAREST)
        image = np.zeros((self.img_size, self.img_size), np.float32)
        image[:nh, :nw] = img / 255.0
        dpad = np.zeros((self.img_size, self.img_size), np.float32)
        dpad[:nh, :nw] = depth
        mask = np.zeros((self.img_size // 8, self.img_size // 8), bool)
        mask[: nh // 8, : nw // 8] = True
        K = self.intrinsics[idx].astype(np.float32).copy()
        K[0] *= nw / w
        K[1] *= nh / h
        return image, dpad, mask, K, np.array([w / nw, h / nh], np.float32)

    def __getitem__(self, i):
        i0, i1 = self.pairs[i]
        im0, d0, m0, K0, s0 = self._load(i0)
        im1, d1, m1, K1, s1 = self._load(i1)
        T0, T1 = self.poses[i0], self.poses[i1]
        T_0to1 = (T1 @ np.linalg.inv(T0)).astype(np.float32)
        return {
            "image0": torch.from_numpy(im0)[None], "image1": torch.from_numpy(im1)[None],
            "depth0": torch.from_numpy(d0), "depth1": torch.from_numpy(d1),
            "mask0": torch.from_numpy(m0), "mask1": torch.from_numpy(m1),
            "K0": torch.from_numpy(K0), "K1": torch.from_numpy(K1),
            "scale0": torch.from_numpy(s0), "scale1": torch.from_numpy(s1),
            "T_0to1": torch.from_numpy(T_0to1), "T_1to0": torch.from_numpy(np.linalg.inv(T_0to1)),
        }


def build_dataset(root, list_file, img_size, n_pairs):
    with open(list_file) as f:
        scenes = [l.strip() for l in f if l.strip()]
    parts = [MegaDepthScene(root, os.path.join(root, "scene_info", s + ".npz"), img_size, n_pairs) for s in scenes]
    return ConcatDataset(parts)


# ----------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu((x if self.down is None else self.down(x)) + y)


class LinearAttention(nn.Module):
    def forward(self, q, k, v, kv_mask=None):
        q, k = F.elu(q) + 1, F.elu(k) + 1
        if kv_mask is not None:
            k = k * kv_mask[:, :, None, None]
            v = v * kv_mask[:, :, None, None]
        n = v.size(1)
        kv = torch.einsum("nshd,nshv->nhdv", k, v / n)
        z = 1.0 / (torch.einsum("nlhd,nhd->nlh", q, k.sum(dim=1)) + 1e-6)
        return torch.einsum("nlhd,nhdv,nlh->nlhv", q, kv, z) * n


class EncoderLayer(nn.Module):
    def __init__(self, d, nhead):
        super().__init__()
        self.nhead, self.hd = nhead, d // nhead
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.merge = nn.Linear(d, d, bias=False)
        self.attn = LinearAttention()
        self.mlp = nn.Sequential(nn.Linear(2 * d, 2 * d, bias=False), nn.ReLU(True), nn.Linear(2 * d, d, bias=False))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, src, src_mask=None):
        b = x.size(0)
        q = self.q(x).view(b, -1, self.nhead, self.hd)
        k = self.k(src).view(b, -1, self.nhead, self.hd)
        v = self.v(src).view(b, -1, self.nhead, self.hd)
        msg = self.norm1(self.merge(self.attn(q, k, v, src_mask).reshape(b, -1, self.nhead * self.hd)))
        return x + self.norm2(self.mlp(torch.cat([x, msg], -1)))


def sine_pe(d, h, w, device):
    pe = torch.zeros(d, h, w, device=device)
    y = torch.arange(h, device=device).float()[:, None].expand(h, w)
    x = torch.arange(w, device=device).float()[None].expand(h, w)
    div = torch.exp(torch.arange(0, d // 2, 2, device=device).float() * (-math.log(10000.0) / (d // 2)))[:, None, None]
    pe[0::4], pe[1::4] = torch.sin(x[None] * div), torch.cos(x[None] * div)
    pe[2::4], pe[3::4] = torch.sin(y[None] * div), torch.cos(y[None] * div)
    return pe


class CoarseLoFTR(nn.Module):
    def __init__(self, d=256, nhead=8, n_layers=4, temperature=0.1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 128, 7, 2, 3, bias=False), nn.BatchNorm2d(128), nn.ReLU(True))
        self.layer1 = nn.Sequential(BasicBlock(128, 128), BasicBlock(128, 128))
        self.layer2 = nn.Sequential(BasicBlock(128, 196, 2), BasicBlock(196, 196))
        self.layer3 = nn.Sequential(BasicBlock(196, d, 2), BasicBlock(d, d))
        self.layers = nn.ModuleList([EncoderLayer(d, nhead) for _ in range(2 * n_layers)])
        self.temperature = temperature

    def forward(self, image0, image1, mask0, mask1):
        b = image0.size(0)
        f = self.layer3(self.layer2(self.layer1(self.stem(torch.cat([image0, image1], 0)))))
        f = f + sine_pe(f.size(1), f.size(2), f.size(3), f.device)[None]
        f = f.flatten(2).transpose(1, 2)
        f0, f1 = f[:b], f[b:]
        m0, m1 = mask0.flatten(1).float(), mask1.flatten(1).float()
        for i, layer in enumerate(self.layers):
            if i % 2 == 0:
                f0, f1 = layer(f0, f0, m0), layer(f1, f1, m1)
            else:
                f0, f1 = layer(f0, f1, m1), layer(f1, f0, m0)
        f0, f1 = f0 / f0.size(-1) ** 0.5, f1 / f1.size(-1) ** 0.5
        sim = torch.einsum("nlc,nsc->nls", f0, f1) / self.temperature
        valid = m0[:, :, None] * m1[:, None, :]
        sim = sim.masked_fill(valid == 0, -1e9)
        return F.softmax(sim, 1) * F.softmax(sim, 2)


# ----------------------------------------------------------------------------- supervision
def warp_kpts(kpts0, depth0, depth1, T_0to1, K0, K1):
    kl = kpts0.round().long()
    b_idx = torch.arange(kpts0.size(0), device=kpts0.device)[:, None]
    z0 = depth0[b_idx, kl[..., 1], kl[..., 0]]
    pts = torch.cat([kpts0, torch.ones_like(kpts0[..., :1])], -1) * z0[..., None]
    cam = T_0to1[:, :3, :3] @ (K0.inverse() @ pts.transpose(1, 2)) + T_0to1[:, :3, 3:]
    proj = (K1 @ cam).transpose(1, 2)
    w = proj[..., :2] / (proj[..., 2:] + 1e-4)
    H, W = depth1.shape[1:]
    inside = (w[..., 0] > 0) & (w[..., 0] < W - 1) & (w[..., 1] > 0) & (w[..., 1] < H - 1)
    wl = w.long().clamp(min=0)
    wl[~inside] = 0
    z1 = depth1[b_idx, wl[..., 1], wl[..., 0]]
    consistent = ((z1 - cam[:, 2]) / (z1 + 1e-6)).abs() < 0.2
    return (z0 > 0) & inside & consistent, w


@torch.no_grad()
def coarse_gt(batch, scale=8):
    d0 = batch["depth0"]
    B, H, W = d0.shape
    h, w = H // scale, W // scale
    ys, xs = torch.meshgrid(torch.arange(h, device=d0.device), torch.arange(w, device=d0.device), indexing="ij")
    grid = (torch.stack([xs, ys], -1).reshape(1, -1, 2).float() * scale).expand(B, -1, -1)
    v01, w01 = warp_kpts(grid, d0, batch["depth1"], batch["T_0to1"], batch["K0"], batch["K1"])
    v10, w10 = warp_kpts(grid, batch["depth1"], d0, batch["T_1to0"], batch["K1"], batch["K0"])
    j = (w01 / scale).round().long()
    j_idx = (j[..., 0] + j[..., 1] * w).clamp(0, h * w - 1)
    back = (w10 / scale).round().long()
    back_idx = (back[..., 0] + back[..., 1] * w).clamp(0, h * w - 1)
    i_idx = torch.arange(h * w, device=d0.device)[None].expand(B, -1)
    mutual = torch.gather(back_idx, 1, j_idx) == i_idx
    ok = v01 & mutual & torch.gather(v10, 1, j_idx)
    gt = torch.zeros(B, h * w, h * w, device=d0.device)
    b, i = ok.nonzero(as_tuple=True)
    gt[b, i, j_idx[b, i]] = 1
    return gt


def focal_loss(conf, gt, alpha=0.25, gamma=2.0, neg_w=1.0):
    conf = conf.clamp(1e-6, 1 - 1e-6)
    pos, neg = gt == 1, gt == 0
    lp = -alpha * (1 - conf[pos]).pow(gamma) * conf[pos].log()
    ln = -alpha * conf[neg].pow(gamma) * (1 - conf[neg]).log()
    lp = lp.mean() if pos.any() else conf.sum() * 0.0
    return lp + neg_w * ln.mean()


# ----------------------------------------------------------------------------- eval
def relative_pose_error(T_0to1, R, t):
    t_gt = T_0to1[:3, 3]
    cos_t = np.dot(t, t_gt) / (np.linalg.norm(t) * np.linalg.norm(t_gt) + 1e-8)
    err_t = np.rad2deg(np.arccos(np.clip(cos_t, -1.0, 1.0)))
    err_t = min(err_t, 180 - err_t)
    cos_r = (np.trace(R.T @ T_0to1[:3, :3]) - 1) / 2
    return err_t, np.rad2deg(np.abs(np.arccos(np.clip(cos_r, -1.0, 1.0))))


def pose_auc(errors, thresholds=(5, 10, 20)):
    errors = np.sort(np.asarray(errors))
    recall = (np.arange(len(errors)) + 1) / len(errors)
    errors, recall = np.r_[0.0, errors], np.r_[0.0, recall]
    aucs = []
    for t in thresholds:
        last = np.searchsorted(errors, t)
        r = np.r_[recall[:last], recall[last - 1]]
        e = np.r_[errors[:last], t]
        aucs.append(np.trapz(r, x=e) / t)
    return aucs


@torch.no_grad()
def evaluate(model, loader, device, thr):
    model.eval()
    results = []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        conf = model(batch["image0"], batch["image1"], batch["mask0"], batch["mask1"])
        w = batch["image0"].shape[-1] // 8
        for b in range(conf.size(0)):
            c = conf[b]
            mnn = (c == c.max(1, keepdim=True)[0]) & (c == c.max(0, keepdim=True)[0]) & (c > thr)
            i, j = mnn.nonzero(as_tuple=True)
            p0 = torch.stack([i % w, i // w], 1).float() * 8 + 4
            p1 = torch.stack([j % w, j // w], 1).float() * 8 + 4
            K0, K1 = batch["K0"][b].cpu().numpy(), batch["K1"][b].cpu().numpy()
            err = 180.0
            if len(i) >= 5:
                k0 = (p0.cpu().numpy() - K0[[0, 1], [2, 2]]) / K0[[0, 1], [0, 1]]
                k1 = (p1.cpu().numpy() - K1[[0, 1], [2, 2]]) / K1[[0, 1], [0, 1]]
                E, inl = cv2.findEssentialMat(k0, k1, np.eye(3), threshold=0.5 / K0[0, 0], prob=0.99999)
                if E is not None and E.shape == (3, 3):
                    _, R, t, _ = cv2.recoverPose(E, k0, k1, np.eye(3), mask=inl)
                    et, er = relative_pose_error(batch["T_0to1"][b].cpu().numpy(), R, t.ravel())
                    err = max(et, er)
            results.append(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    model.train()
    return pose_auc([e for part in gathered for e in part])


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    torch.manual_seed(66)

    train_set = build_dataset(args.data_root, args.train_list, args.img_size, args.pairs_per_scene)
    val_set = build_dataset(args.data_root, args.val_list, args.img_size, 50)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard without padding so every validation pair is counted exactly once
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1, num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CoarseLoFTR()).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.canonical_lr * (world * args.batch_size) / args.canonical_bs
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[3, 6, 9, 12, 17, 20, 23, 26, 29], gamma=0.5)
    logger.info("world=%d effective_bs=%d lr=%.2e train_pairs=%d", world, world * args.batch_size, lr, len(train_set))

    writer = SummaryWriter(args.out) if rank == 0 else None
    os.makedirs(args.out, exist_ok=True)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if step < args.warmup_steps:
                for g in optim.param_groups:
                    g["lr"] = lr * (0.1 + 0.9 * step / args.warmup_steps)
            conf = model(batch["image0"], batch["image1"], batch["mask0"], batch["mask1"])
            loss = focal_loss(conf, coarse_gt(batch))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optim.step()
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item() / world, step)
                    logger.info("ep %d step %d loss %.4f (%.1fs)", epoch, step, l.item() / world, time.time() - t0)
            step += 1
        sched.step()

        auc5, auc10, auc20 = evaluate(model.module, val_loader, device, args.match_thr)
        if rank == 0:
            logger.info("epoch %d AUC@5/10/20: %.2f / %.2f / %.2f", epoch, 100 * auc5, 100 * auc10, 100 * auc20)
            writer.add_scalar("val/auc@5", auc5, epoch)
            writer.add_scalar("val/auc@10", auc10, epoch)
            writer.add_scalar("val/auc@20", auc20, epoch)
            ckpt = {"model": model.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch, "step": step}
            torch.save(ckpt, os.path.join(args.out, "last.ckpt"))
            if auc10 > best:
                best = auc10
                torch.save(ckpt, os.path.join(args.out, "best.ckpt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
