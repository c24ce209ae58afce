"""Single-view reconstruction with an occupancy network + pixel-aligned refinement head.

Stage 1 (epochs < --refine_start): global ResNet feature -> occupancy.
Stage 2: add the pixel-aligned local refinement on top.

    torchrun --nproc_per_node=8 12_svr_occ_refine.py --data data/ShapeNet.build --refine_start 30
"""
import argparse
import os

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
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


class RenderedShapes(Dataset):
    """ShapeNet renderings (24 views) with camera matrices and occupancy samples."""

    def __init__(self, root, split, n_query=2048):
        with open(os.path.join(root, f"{split}.lst")) as f:
            self.models = [l.strip() for l in f if l.strip()]
        self.root, self.split, self.n_query = root, split, n_query
        self.tf = transforms.Compose([transforms.Resize(224), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.models)

    def __getitem__(self, i):
        d = os.path.join(self.root, self.models[i])
        view = np.random.randint(24) if self.split == "train" else 0
        img = self.tf(Image.open(os.path.join(d, "img_choy2016", f"{view:03d}.jpg")).convert("RGB"))
        cams = np.load(os.path.join(d, "img_choy2016", "cameras.npz"))
        world_mat = torch.from_numpy(cams[f"world_mat_{view}"]).float()
        camera_mat = torch.from_numpy(cams[f"camera_mat_{view}"]).float()
        pts = np.load(os.path.join(d, "points.npz"))
        p = pts["points"].astype(np.float32)
        occ = np.unpackbits(pts["occupancies"])[: len(p)].astype(np.float32)
        j = np.random.randint(len(p), size=self.n_query)
        return img, world_mat, camera_mat, torch.from_numpy(p[j]), torch.from_numpy(occ[j])


def project(points, world_mat, camera_mat):
    """Project 3D points to normalised image coords in [-1, 1]."""
    ones = torch.ones_like(points[..., :1])
    p = torch.cat([points, ones], -1) @ world_mat.transpose(1, 2)
    p = p @ camera_mat.transpose(1, 2)
    return p[..., :2] / p[..., 2:3].clamp(min=1e-5)


class ImageEncoder(nn.Module):
    def __init__(self, c_dim=256):
        super().__init__()
        r = torchvision.models.resnet18(weights=torchvision.models.ResNet18_Weights.IMAGENET1K_V1)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2)
        self.tail = nn.Sequential(r.layer3, r.layer4)
        self.fc = nn.Linear(512, c_dim)

    def forward(self, img):
        fmap = self.stem(img)                     # B x 128 x 28 x 28, kept for local features
        g = self.tail(fmap).mean((2, 3))
        return self.fc(g), fmap


class GlobalDecoder(nn.Module):
    def __init__(self, c_dim=256, hidden=256):
        super().__init__()
        self.fc_p = nn.Linear(3, hidden)
        self.fc_c = nn.Linear(c_dim, hidden)
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.ReLU(), nn.Linear(hidden, hidden))])
        self.out = nn.Linear(hidden, 1)

    def forward(self, p, c):
        h = self.fc_p(p) + self.fc_c(c).unsqueeze(1)
        h = self.net(h)
        return self.out(F.relu(h)).squeeze(-1), h


class LocalRefiner(nn.Module):
    def __init__(self, feat_dim=128, hidden=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(feat_dim + hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, fmap, uv, h):
        local = F.grid_sample(fmap, uv.unsqueeze(2), align_corners=False).squeeze(-1).transpose(1, 2)
        return self.mlp(torch.cat([local, h], -1)).squeeze(-1)


class SVROccNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = ImageEncoder()
        self.decoder = GlobalDecoder()
        self.refiner = LocalRefiner()

    def forward(self, img, points, world_mat, camera_mat, refine=True):
        c, fmap = self.encoder(img)
        logits, h = self.decoder(points, c)
        if refine:
            uv = project(points, world_mat, camera_mat)
            logits = logits + self.refiner(fmap, uv, h)
        return logits


@torch.no_grad()
def iou_eval(model, loader, device, refine):
    model.eval()
    stats = torch.zeros(2, device=device)
    for img, wm, cm, p, occ in loader:
        img, wm, cm, p, occ = (t.to(device) for t in (img, wm, cm, p, occ))
        pred = model(img, p, wm, cm, refine=refine) > 0
        gt = occ > 0.5
        iou = (pred & gt).sum(-1).float() / (pred | gt).sum(-1).float().clamp(min=1)
        stats += torch.stack([iou.sum(), torch.tensor(float(len(iou)), device=device)])
    model.train()
    return stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/svr_refine")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--refine_start", type=int, default=30)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = RenderedShapes(args.data, "train")
    val_ds = RenderedShapes(args.data, "val")
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 64, sampler=va_sampler, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SVROccNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        refine = epoch >= args.refine_start
        for img, wm, cm, p, occ in train_dl:
            img, wm, cm, p, occ = (t.to(device, non_blocking=True) for t in (img, wm, cm, p, occ))
            logits = model(img, p, wm, cm, refine=refine)
            loss = F.binary_cross_entropy_with_logits(logits, occ, reduction="none").sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        stats = iou_eval(model, val_dl, device, refine)
        dist.all_reduce(stats)
        if rank == 0:
            val_iou = (stats[0] / stats[1]).item()
            writer.add_scalar("val/iou", val_iou, step)
            print(f"epoch {epoch} refine={refine} val IoU {val_iou:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
