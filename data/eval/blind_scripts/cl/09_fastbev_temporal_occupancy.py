"""Fast-BEV style camera occupancy (Occ3D-nuScenes, 0.8 m voxels) with previous-frame fusion.

Image features are back-projected by sampling them at the projected voxel centres
(uniform depth), the voxel volume is collapsed to BEV and decoded per height slice.

    torchrun --nproc_per_node=8 09_fastbev_temporal_occupancy.py --out /nas/occ/fastbev_t
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLS, FREE_ID = 18, 17
X, Y, Z = 128, 128, 16          # voxel grid
VOX = 0.8
RANGE = (-51.2, -51.2, -5.0)
IH, IW = 256, 704


def cli():
    a = argparse.ArgumentParser()
    a.add_argument("--root", default="/nas/datasets/nuscenes")
    a.add_argument("--occ-root", default="/nas/datasets/occ3d/gts")
    a.add_argument("--out", default="/nas/occ/fastbev_t")
    a.add_argument("--epochs", type=int, default=24)
    a.add_argument("--bs", type=int, default=2)
    a.add_argument("--lr", type=float, default=1e-4)
    a.add_argument("--workers", type=int, default=4)
    return a.parse_args()


class OccFrames(Dataset):
    def __init__(self, root, occ_root, split):
        with open(os.path.join(root, f"occ_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)  # sorted by scene, then timestamp
        self.root, self.occ_root = root, occ_root
        self.mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        self.std = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __len__(self):
        return len(self.infos)

    def _cams(self, info):
        imgs, projs = [], []
        for cam in info["cams"]:
            im = Image.open(os.path.join(self.root, cam["path"])).convert("RGB")
            s = np.diag([IW / im.width, IH / im.height, 1.0, 1.0]).astype(np.float32)
            im = (np.asarray(im.resize((IW, IH)), dtype=np.float32) / 255.0 - self.mean) / self.std
            imgs.append(torch.from_numpy(im).permute(2, 0, 1))
            projs.append(torch.from_numpy(s @ np.asarray(cam["ego2img"], dtype=np.float32)))
        return torch.stack(imgs), torch.stack(projs)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, projs = self._cams(info)
        occ = np.load(os.path.join(self.occ_root, info["scene_name"], info["token"], "labels.npz"))
        item = {"imgs": imgs, "projs": projs, "sem": torch.from_numpy(occ["semantics"]).long(),
                "mask": torch.from_numpy(occ["mask_camera"]).bool()}
        prev = self.infos[i - 1] if i > 0 else None
        if prev is not None and prev["scene_name"] == info["scene_name"]:
            item["prev_imgs"], item["prev_projs"] = self._cams(prev)
            item["prev2cur"] = torch.tensor(np.linalg.inv(info["ego2global"]) @ prev["ego2global"], dtype=torch.float32)
        return item


def collate(batch):
    out = {k: torch.stack([b[k] for b in batch]) for k in ("imgs", "projs", "sem", "mask")}
    if all("prev_imgs" in b for b in batch):
        for k in ("prev_imgs", "prev_projs", "prev2cur"):
            out[k] = torch.stack([b[k] for b in batch])
    return out


def conv_gn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(32, cout), nn.ReLU(inplace=True))


class FastBEVOcc(nn.Module):
    def __init__(self, C=64):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.img_backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.img_neck = nn.Conv2d(256, C, 1)
        zs, ys, xs = torch.meshgrid(torch.arange(Z), torch.arange(Y), torch.arange(X), indexing="ij")
        centers = torch.stack([xs, ys, zs], -1).float() * VOX + torch.tensor(RANGE) + VOX / 2
        self.register_buffer("centers", torch.cat([centers, torch.ones_like(centers[..., :1])], -1).view(-1, 4),
                             persistent=False)
        self.C = C
        self.z_collapse = conv_gn(C * Z // 4, 256)
        self.temporal_fuse = nn.Sequential(conv_gn(512, 256), conv_gn(256, 256))
        self.bev_encoder = nn.Sequential(conv_gn(256, 256), conv_gn(256, 256), conv_gn(256, 256))
        self.occ_head = nn.Conv2d(256, NUM_CLS * Z, 1)

    def train(self, mode=True):
        super().train(mode)
        for m in self.img_backbone.modules():  # keep ImageNet BN statistics (batch is 2 x 6 images)
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def to_bev(self, imgs, projs):
        B, N = imgs.shape[:2]
        feat = self.img_neck(self.img_backbone(imgs.flatten(0, 1)))  # (BN, C, h, w)
        pix = torch.einsum("bnij,pj->bnpi", projs, self.centers)
        d = pix[..., 2].clamp(min=1e-3)
        u, v = pix[..., 0] / d / IW * 2 - 1, pix[..., 1] / d / IH * 2 - 1
        valid = (pix[..., 2] > 1e-3) & (u.abs() < 1) & (v.abs() < 1)
        grid = torch.stack([u, v], -1).view(B * N, 1, -1, 2)
        s = F.grid_sample(feat, grid, align_corners=False).view(B, N, self.C, -1)
        w = valid.unsqueeze(2).float()
        vol = (s * w).sum(1) / w.sum(1).clamp(min=1)  # (B, C, Z*Y*X)
        vol = vol.view(B, self.C, Z, Y, X)
        vol = F.avg_pool3d(vol, (4, 1, 1))  # 16 -> 4 height bins
        return self.z_collapse(vol.flatten(1, 2))

    @staticmethod
    def warp(prev_bev, prev2cur):
        # sample prev BEV at positions of current cells expressed in prev ego frame
        B = prev_bev.shape[0]
        cur2prev = torch.inverse(prev2cur)
        theta = torch.zeros(B, 2, 3, device=prev_bev.device)
        theta[:, :, :2] = cur2prev[:, :2, :2]
        theta[:, :, 2] = cur2prev[:, :2, 3] / (-RANGE[0])
        grid = F.affine_grid(theta, prev_bev.shape, align_corners=False)
        return F.grid_sample(prev_bev, grid, align_corners=False)

    def forward(self, imgs, projs, prev_imgs=None, prev_projs=None, prev2cur=None):
        bev = self.to_bev(imgs, projs)
        if prev_imgs is not None:
            with torch.no_grad():
                prev_bev = self.to_bev(prev_imgs, prev_projs)
            bev = self.temporal_fuse(torch.cat([bev, self.warp(prev_bev, prev2cur)], 1))
        logits = self.occ_head(self.bev_encoder(bev))
        B = logits.shape[0]
        return logits.view(B, NUM_CLS, Z, Y, X)


def occ_loss(logits, sem, mask, cls_w):
    return (F.cross_entropy(logits, sem, weight=cls_w, reduction="none") * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def miou(net, loader, dev):
    net.eval()
    hist = torch.zeros(NUM_CLS, NUM_CLS, device=dev, dtype=torch.long)
    for b in loader:
        b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
        pred = net(**{k: b[k] for k in ("imgs", "projs", "prev_imgs", "prev_projs", "prev2cur") if k in b}).argmax(1)
        m = b["mask"]
        hist += torch.bincount(b["sem"][m] * NUM_CLS + pred[m], minlength=NUM_CLS ** 2).view(NUM_CLS, NUM_CLS)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    net.train()
    return iou[:FREE_ID].mean().item(), iou.tolist()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")

    tr = OccFrames(args.root, args.occ_root, "train")
    va = OccFrames(args.root, args.occ_root, "val")
    tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_loader = DataLoader(tr, args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=args.workers,
                           pin_memory=True, drop_last=True)
    va_loader = DataLoader(torch.utils.data.Subset(va, range(rank, len(va), world)), args.bs,
                           collate_fn=collate, num_workers=args.workers)

    net = FastBEVOcc().to(dev)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world * args.bs / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(tr_loader), eta_min=lr * 1e-3)
    cls_w = torch.ones(NUM_CLS, device=dev)
    cls_w[FREE_ID] = 0.2
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for ep in range(args.epochs):
        tr_sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        for it, b in enumerate(tr_loader):
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            logits = model(b["imgs"], b["projs"], b.get("prev_imgs"), b.get("prev_projs"), b.get("prev2cur"))
            loss = occ_loss(logits, b["sem"], b["mask"].float(), cls_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {ep} it {it}/{len(tr_loader)} loss {l.item():.4f} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        m, per_cls = miou(net, va_loader, dev)
        if rank == 0:
            print(f"ep {ep} mIoU {m:.4f} | " + " ".join(f"{v:.3f}" for v in per_cls), flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": ep},
                       os.path.join(args.out, f"ep{ep:02d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
