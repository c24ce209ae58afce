"""SMOKE-style single-stage monocular 3D detection on KITTI (Car / Pedestrian / Cyclist).

    torchrun --nproc_per_node=4 tools/train_smoke.py --config configs/smoke_r34_kitti.yaml
"""
import argparse
import os
import pickle

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Car", "Pedestrian", "Cyclist"]
DIM_REF = torch.tensor([[3.88, 1.63, 1.53], [0.84, 1.76, 0.66], [1.76, 1.73, 0.60]])  # l, h, w
DEPTH_REF = (28.01, 16.32)
INPUT = (384, 1280)
DOWN = 4
MAX_OBJ = 50


class KittiMono3D(Dataset):
    def __init__(self, root, info_file, train):
        with open(os.path.join(root, info_file), "rb") as f:
            self.infos = pickle.load(f)
        self.root, self.train = root, train
        self.mean = np.array([0.485, 0.456, 0.406], np.float32)
        self.std = np.array([0.229, 0.224, 0.225], np.float32)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        img = cv2.imread(os.path.join(self.root, info["image_path"]))[..., ::-1]
        P2 = info["calib"]["P2"][:3, :3].astype(np.float32)
        h, w = img.shape[:2]
        sx, sy = INPUT[1] / w, INPUT[0] / h
        img = cv2.resize(img, (INPUT[1], INPUT[0]))
        K = P2.copy()
        K[0] *= sx
        K[1] *= sy
        flip = self.train and np.random.rand() < 0.5
        if flip:
            img = img[:, ::-1]
            K[0, 2] = INPUT[1] - K[0, 2]
        img = ((img.astype(np.float32) / 255.0 - self.mean) / self.std).transpose(2, 0, 1)

        Ho, Wo = INPUT[0] // DOWN, INPUT[1] // DOWN
        hm = np.zeros((len(CLASSES), Ho, Wo), np.float32)
        ind = np.zeros(MAX_OBJ, np.int64)
        mask = np.zeros(MAX_OBJ, np.float32)
        cls = np.zeros(MAX_OBJ, np.int64)
        off = np.zeros((MAX_OBJ, 2), np.float32)
        loc = np.zeros((MAX_OBJ, 3), np.float32)
        dim = np.zeros((MAX_OBJ, 3), np.float32)
        ry = np.zeros(MAX_OBJ, np.float32)
        a = info["annos"]
        keep = [i for i, n in enumerate(a["name"]) if n in CLASSES and a["truncated"][i] < 0.5][:MAX_OBJ]
        for k, i in enumerate(keep):
            x, y, z = a["location"][i]
            y -= a["dimensions"][i][1] / 2  # bottom centre -> 3D centre
            rot = a["rotation_y"][i]
            if flip:
                x, rot = -x, np.pi - rot if rot > 0 else -np.pi - rot
            uvw = K @ np.array([x, y, z], np.float32)
            u, v = uvw[0] / uvw[2] / DOWN, uvw[1] / uvw[2] / DOWN
            iu, iv = int(u), int(v)
            if not (0 <= iu < Wo and 0 <= iv < Ho) or z <= 0:
                continue
            c = CLASSES.index(a["name"][i])
            rad = max(1, int(np.hypot(*(a["bbox"][i][2:] - a["bbox"][i][:2])) * sx / DOWN / 12))
            xs, ys = np.arange(Wo)[None], np.arange(Ho)[:, None]
            hm[c] = np.maximum(hm[c], np.exp(-((xs - iu) ** 2 + (ys - iv) ** 2) / (2 * (rad / 3 + 0.5) ** 2)))
            ind[k], mask[k], cls[k] = iv * Wo + iu, 1, c
            off[k] = (u - iu, v - iv)
            loc[k] = (x, y, z)
            dim[k] = a["dimensions"][i][[0, 1, 2]]
            ry[k] = rot
        return {"img": torch.from_numpy(img.copy()), "K": torch.from_numpy(K), "hm": torch.from_numpy(hm),
                "ind": torch.from_numpy(ind), "mask": torch.from_numpy(mask), "cls": torch.from_numpy(cls),
                "off": torch.from_numpy(off), "loc": torch.from_numpy(loc), "dim": torch.from_numpy(dim),
                "ry": torch.from_numpy(ry)}


def build_dataloaders(cfg):
    train_set = KittiMono3D(cfg["root"], "kitti_infos_train.pkl", True)
    val_set = KittiMono3D(cfg["root"], "kitti_infos_val.pkl", False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, cfg["imgs_per_gpu"], sampler=train_sampler, num_workers=cfg["workers"],
                              pin_memory=True, drop_last=True)
    val_shard = torch.utils.data.Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))
    val_loader = DataLoader(val_shard, cfg["imgs_per_gpu"], shuffle=False, num_workers=cfg["workers"])
    return train_loader, val_loader, train_sampler, len(val_set)


class SMOKE(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.l1, self.l2, self.l3, self.l4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.fuse3 = nn.Conv2d(256 + 512, 256, 3, 1, 1)
        self.fuse2 = nn.Conv2d(128 + 256, 128, 3, 1, 1)
        self.fuse1 = nn.Conv2d(64 + 128, 64, 3, 1, 1)
        self.gn = nn.ModuleList([nn.GroupNorm(32, c) for c in (256, 128, 64)])

        def head(cout):
            return nn.Sequential(nn.Conv2d(64, 256, 3, 1, 1), nn.GroupNorm(32, 256), nn.ReLU(), nn.Conv2d(256, cout, 1))
        self.hm_head, self.reg_head = head(len(CLASSES)), head(8)  # dz, du, dv, dl, dh, dw, sin, cos
        nn.init.constant_(self.hm_head[-1].bias, -2.19)

    def forward(self, x):
        c1 = self.l1(self.stem(x))
        c2 = self.l2(c1)
        c3 = self.l3(c2)
        c4 = self.l4(c3)
        y = F.relu(self.gn[0](self.fuse3(torch.cat([c3, F.interpolate(c4, size=c3.shape[-2:])], 1))))
        y = F.relu(self.gn[1](self.fuse2(torch.cat([c2, F.interpolate(y, size=c2.shape[-2:])], 1))))
        y = F.relu(self.gn[2](self.fuse1(torch.cat([c1, F.interpolate(y, size=c1.shape[-2:])], 1))))
        return self.hm_head(y), self.reg_head(y)


def decode_regs(reg, ind, cls, K):
    B, C, H, W = reg.shape
    r = reg.flatten(2).gather(2, ind[:, None].expand(-1, C, -1)).transpose(1, 2)  # B, N, 8
    z = DEPTH_REF[0] + r[..., 0] * DEPTH_REF[1]
    u = ((ind % W).float() + r[..., 1]) * DOWN
    v = ((ind // W).float() + r[..., 2]) * DOWN
    uv1 = torch.stack([u * z, v * z, z], -1)
    xyz = torch.einsum("bij,bnj->bni", torch.inverse(K), uv1)
    dims = DIM_REF.to(reg.device)[cls] * r[..., 3:6].exp()
    return xyz, dims, r[..., 6:8]


def smoke_loss(hm_p, reg_p, b):
    p = hm_p.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = b["hm"].eq(1).float()
    l_hm = -(pos * (1 - p) ** 2 * p.log() + (1 - pos) * (1 - b["hm"]) ** 4 * p ** 2 * (1 - p).log()).sum()
    l_hm = l_hm / pos.sum().clamp(min=1)
    xyz, dims, ori = decode_regs(reg_p, b["ind"], b["cls"], b["K"])
    m = b["mask"][..., None]
    n = b["mask"].sum().clamp(min=1)
    l_loc = (F.l1_loss(xyz, b["loc"], reduction="none") * m).sum() / n
    l_dim = (F.l1_loss(dims, b["dim"], reduction="none") * m).sum() / n
    tgt_ori = torch.stack([b["ry"].sin(), b["ry"].cos()], -1)
    l_ori = (F.l1_loss(F.normalize(ori, dim=-1), tgt_ori, reduction="none") * m).sum() / n
    return l_hm + 0.3 * l_loc + 0.5 * l_dim + l_ori, {"hm": l_hm.item(), "loc": l_loc.item(), "dim": l_dim.item()}


@torch.no_grad()
def evaluate(model, loader, device, n_val):
    """Mean 3D centre error (m) and recall@2m of the GT objects, read out at the GT peak locations."""
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for b in loader:
        b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        _, reg = model(b["img"])
        xyz, _, _ = decode_regs(reg, b["ind"], b["cls"], b["K"])
        err = (xyz - b["loc"]).norm(dim=-1)[b["mask"] > 0]
        s[0] += err.sum()
        s[1] += (err < 2.0).sum()
        s[2] += err.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2].clamp(min=1)).item(), (s[1] / s[2].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    train_loader, val_loader, train_sampler, n_val = build_dataloaders(cfg)
    model = SMOKE()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    base_lr = cfg["base_lr"] * world * cfg["imgs_per_gpu"] / 32
    opt = torch.optim.Adam(model.parameters(), lr=base_lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, cfg["lr_steps"], 0.1)

    it_global, start_epoch = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, it_global = ck["epoch"] + 1, ck["iteration"]

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for b in train_loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            hm_p, reg_p = model(b["img"])
            loss, parts = smoke_loss(hm_p, reg_p, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            it_global += 1
            if rank == 0 and it_global % 20 == 0:
                print(f"epoch {epoch} iter {it_global} loss {loss.item():.3f} " +
                      " ".join(f"{k} {v:.3f}" for k, v in parts.items()), flush=True)
        sched.step()

        err, rec = evaluate(model.module, val_loader, device, n_val)
        if rank == 0:
            print(f"epoch {epoch}: val centre err {err:.3f} m, recall@2m {rec:.3f}", flush=True)
            os.makedirs(cfg["output_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "iteration": it_global},
                       os.path.join(cfg["output_dir"], "model_final.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
