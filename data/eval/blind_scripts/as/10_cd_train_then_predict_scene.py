"""
Bi-temporal change detection on co-registered aerial scenes (e.g. S2Looking / SYSU-CD),
followed by full-scene prediction with the best checkpoint, written as a GeoTIFF
change map with the input scene's georeferencing.

    torchrun --nproc_per_node=4 cd_train_predict.py --train-root /data/cd/train --val-root /data/cd/val \
        --scene-t1 /data/cd/scenes/2019.tif --scene-t2 /data/cd/scenes/2022.tif
"""
import argparse
import os
import time

import numpy as np
import rasterio
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import timm
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-root", required=True)
    p.add_argument("--val-root", required=True)
    p.add_argument("--scene-t1", default=None)
    p.add_argument("--scene-t2", default=None)
    p.add_argument("--encoder", default="efficientnet_b1")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--tile", type=int, default=512)
    p.add_argument("--work-dir", default="work_dirs/cd_effb1")
    return p.parse_args()


class PairFolder(Dataset):
    def __init__(self, root, train):
        self.root = root
        self.names = sorted(os.listdir(os.path.join(root, "T1")))
        self.train = train

    def __len__(self):
        return len(self.names)

    def _img(self, sub, n):
        a = np.asarray(Image.open(os.path.join(self.root, sub, n)).convert("RGB"), np.float32)
        return (a.transpose(2, 0, 1) / 255.0 - MEAN) / STD

    def __getitem__(self, i):
        n = self.names[i]
        t1, t2 = self._img("T1", n), self._img("T2", n)
        y = (np.asarray(Image.open(os.path.join(self.root, "label", n))) > 0).astype(np.float32)
        if self.train:
            if np.random.rand() < 0.5:
                t1, t2, y = t1[..., ::-1], t2[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                t1, t2 = t2, t1
        return (torch.from_numpy(t1.copy()), torch.from_numpy(t2.copy()),
                torch.from_numpy(y.copy())[None])


class SiamFPN(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = timm.create_model(encoder, pretrained=True, features_only=True, out_indices=(1, 2, 3, 4))
        chs = self.encoder.feature_info.channels()
        self.lat = nn.ModuleList([nn.Conv2d(2 * c, 96, 1) for c in chs])
        self.dec = nn.Sequential(nn.Conv2d(96, 96, 3, padding=1), nn.BatchNorm2d(96), nn.ReLU(True),
                                 nn.Conv2d(96, 1, 1))

    def forward(self, t1, t2):
        f1, f2 = self.encoder(t1), self.encoder(t2)
        x = None
        for lat, a, b in reversed(list(zip(self.lat, f1, f2))):
            y = lat(torch.cat([a, torch.abs(a - b)], 1))
            x = y if x is None else y + F.interpolate(x, size=y.shape[-2:], mode="bilinear", align_corners=False)
        return F.interpolate(self.dec(x), size=t1.shape[-2:], mode="bilinear", align_corners=False)


def read_scene(path):
    with rasterio.open(path) as src:
        arr = src.read([1, 2, 3]).astype(np.float32) / 255.0
        profile = src.profile
    return (arr - MEAN) / STD, profile


@torch.no_grad()
def predict_scene(model, t1_path, t2_path, out_path, tile, device, overlap=64):
    model.eval()
    a, profile = read_scene(t1_path)
    b, _ = read_scene(t2_path)
    _, H, W = a.shape
    acc = np.zeros((H, W), np.float32)
    cnt = np.zeros((H, W), np.float32)
    step = tile - overlap
    for y in range(0, max(H - overlap, 1), step):
        for x in range(0, max(W - overlap, 1), step):
            y0, x0 = min(y, max(H - tile, 0)), min(x, max(W - tile, 0))
            pa = torch.from_numpy(a[:, y0:y0 + tile, x0:x0 + tile]).unsqueeze(0).to(device)
            pb = torch.from_numpy(b[:, y0:y0 + tile, x0:x0 + tile]).unsqueeze(0).to(device)
            prob = model(pa, pb).sigmoid()[0, 0].cpu().numpy()
            acc[y0:y0 + prob.shape[0], x0:x0 + prob.shape[1]] += prob
            cnt[y0:y0 + prob.shape[0], x0:x0 + prob.shape[1]] += 1
    change = ((acc / np.maximum(cnt, 1)) > 0.5).astype(np.uint8)
    profile.update(count=1, dtype="uint8", nodata=None, compress="deflate")
    with rasterio.open(out_path, "w", **profile) as dst:
        dst.write(change, 1)


def main():
    args = args_parser()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    tr = PairFolder(args.train_root, train=True)
    va = PairFolder(args.val_root, train=False)
    tr_sampler = DistributedSampler(tr, shuffle=True)
    tr_dl = DataLoader(tr, args.bs, sampler=tr_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, args.bs, sampler=DistributedSampler(va, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    net = SiamFPN(args.encoder)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    pos_weight = torch.tensor([3.0], device=device)

    best_f1 = -1.0
    best_path = os.path.join(args.work_dir, "best.pth")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for t1, t2, y in tr_dl:
            t1, t2, y = t1.to(device, non_blocking=True), t2.to(device, non_blocking=True), y.to(device)
            logits = model(t1, t2)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        c = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for t1, t2, y in va_dl:
                t1, t2, y = t1.to(device), t2.to(device), y.to(device)
                p = (model(t1, t2) > 0).float()
                c += torch.stack([(p * y).sum(), (p * (1 - y)).sum(), ((1 - p) * y).sum()]).double()
        dist.all_reduce(c)
        f1 = (2 * c[0] / (2 * c[0] + c[1] + c[2]).clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0 and args.scene_t1 and args.scene_t2:
        infer_net = SiamFPN(args.encoder).to(device)
        infer_net.load_state_dict(torch.load(best_path, map_location=device))
        out_path = os.path.join(args.work_dir, "change_map.tif")
        predict_scene(infer_net, args.scene_t1, args.scene_t2, out_path, args.tile, device)
        print(f"wrote {out_path} (best val F1 {best_f1:.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
