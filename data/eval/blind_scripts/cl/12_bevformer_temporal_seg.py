"""BEVFormer-lite with temporal self-attention over the previous keyframe's BEV,
vehicle + drivable-area segmentation on nuScenes.

    torchrun --nproc_per_node=8 12_bevformer_temporal_seg.py --exp bevformer_t_r50
"""
import argparse
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BEV = 100
RES = 1.0
H, W = 224, 480
CAMS = ["CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_RIGHT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_FRONT_LEFT"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataroot", default="/data/nuscenes")
    ap.add_argument("--info-dir", default="/data/nuscenes/bevformer_lite_infos")
    ap.add_argument("--exp", default="bevformer_t")
    ap.add_argument("--out", default="/data/runs")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def build_infos(dataroot, split):
    from nuscenes import NuScenes
    from nuscenes.utils.splits import create_splits_scenes
    nusc = NuScenes("v1.0-trainval", dataroot, verbose=False)
    wanted = set(create_splits_scenes()[split])
    infos = []
    for scene in nusc.scene:
        if scene["name"] not in wanted:
            continue
        tok, prev = scene["first_sample_token"], None
        while tok:
            s = nusc.get("sample", tok)
            cams = []
            for c in CAMS:
                sd = nusc.get("sample_data", s["data"][c])
                cs = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
                cams.append({"path": sd["filename"], "K": cs["camera_intrinsic"],
                             "t": cs["translation"], "q": cs["rotation"]})
            infos.append({"token": tok, "scene": scene["name"], "prev": prev, "cams": cams,
                          "label": f"bev_labels/{tok}.npz"})
            prev, tok = tok, s["next"] or None
    return infos


def prepare_infos(args, split, rank):
    path = os.path.join(args.info_dir, f"{split}.pkl")
    if rank == 0 and not os.path.exists(path):
        os.makedirs(args.info_dir, exist_ok=True)
        infos = build_infos(args.dataroot, split)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(infos, f)
        os.replace(tmp, path)
    dist.barrier()
    with open(path, "rb") as f:
        return pickle.load(f)


def cam_matrices(cam):
    from pyquaternion import Quaternion
    K = np.asarray(cam["K"], dtype=np.float32)
    R = Quaternion(cam["q"]).rotation_matrix.astype(np.float32)
    ego2cam = np.eye(4, dtype=np.float32)
    ego2cam[:3, :3] = R.T
    ego2cam[:3, 3] = -R.T @ np.asarray(cam["t"], dtype=np.float32)
    return K, ego2cam


class TemporalBEVData(Dataset):
    def __init__(self, dataroot, infos):
        self.root, self.infos = dataroot, infos
        self.by_token = {inf["token"]: i for i, inf in enumerate(infos)}
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.infos)

    def load_frame(self, info):
        imgs, projs = [], []
        for cam in info["cams"]:
            im = Image.open(os.path.join(self.root, cam["path"])).convert("RGB")
            K, e2c = cam_matrices(cam)
            K = np.diag([W / im.width, H / im.height, 1.0]).astype(np.float32) @ K
            P = np.eye(4, dtype=np.float32)
            P[:3, :3] = K
            imgs.append(self.norm(torchvision.transforms.functional.to_tensor(im.resize((W, H)))))
            projs.append(torch.from_numpy(P @ e2c))
        return torch.stack(imgs), torch.stack(projs)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, projs = self.load_frame(info)
        lab = np.load(os.path.join(self.root, info["label"]))["bev"]  # (2, 100, 100)
        prev_i = self.by_token.get(info["prev"])
        out = {"imgs": imgs, "projs": projs, "label": torch.from_numpy(lab).float()}
        if prev_i is not None:
            out["prev_imgs"], out["prev_projs"] = self.load_frame(self.infos[prev_i])
        return out


def collate(batch):
    out = {k: torch.stack([b[k] for b in batch]) for k in ("imgs", "projs", "label")}
    if all("prev_imgs" in b for b in batch):
        out["prev_imgs"] = torch.stack([b["prev_imgs"] for b in batch])
        out["prev_projs"] = torch.stack([b["prev_projs"] for b in batch])
    return out


class BEVFormerT(nn.Module):
    def __init__(self, dim=128, layers=2):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3)
        self.reduce = nn.Conv2d(1024, dim, 1)
        self.queries = nn.Parameter(torch.zeros(BEV * BEV, dim))
        self.pos = nn.Parameter(torch.randn(BEV * BEV, dim) * 0.02)
        ys, xs = torch.meshgrid(torch.arange(BEV), torch.arange(BEV), indexing="ij")
        pts = [torch.stack([(xs + 0.5) * RES - BEV * RES / 2, (ys + 0.5) * RES - BEV * RES / 2,
                            torch.full_like(xs, z, dtype=torch.float), torch.ones(BEV, BEV)], -1).view(-1, 4).float()
               for z in (-1.0, 0.5, 2.0)]
        self.register_buffer("ref", torch.stack(pts, 1), persistent=False)  # (HW, 3, 4)
        self.temporal = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.temporal_norm = nn.LayerNorm(dim)
        self.sca_proj = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(layers)])
        self.head = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GroupNorm(8, dim), nn.ReLU(True),
                                  nn.Conv2d(dim, 2, 1))

    def train(self, mode=True):
        super().train(mode)
        for m in self.backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def sample_cams(self, feats, projs):
        B, N, C, h, w = feats.shape
        p = torch.einsum("bnij,pzj->bnpzi", projs, self.ref)
        d = p[..., 2:3].clamp(min=1e-4)
        uv = torch.cat([p[..., :1] / d / W, p[..., 1:2] / d / H], -1) * 2 - 1
        ok = ((p[..., 2] > 1e-4) & (uv.abs() < 1).all(-1)).float()  # (B, N, HW, Z)
        s = F.grid_sample(feats.flatten(0, 1), uv.flatten(0, 1), align_corners=False).view(B, N, C, -1, 3)
        return (s * ok[:, :, None]).sum((1, 4)).transpose(1, 2) / ok.sum((1, 3))[..., None].clamp(min=1)

    def encode(self, imgs, projs, prev_bev=None):
        B, N = imgs.shape[:2]
        feats = self.reduce(self.backbone(imgs.flatten(0, 1)))
        feats = feats.view(B, N, *feats.shape[1:])
        bev = self.queries.expand(B, -1, -1) + self.pos
        if prev_bev is not None:
            attn, _ = self.temporal(bev, prev_bev, prev_bev)
            bev = self.temporal_norm(bev + attn)
        for proj, ffn in zip(self.sca_proj, self.ffn):
            bev = bev + proj(self.sample_cams(feats, projs))
            bev = bev + ffn(bev)
        return bev

    def forward(self, imgs, projs, prev_imgs=None, prev_projs=None):
        prev_bev = None
        if prev_imgs is not None:
            with torch.no_grad():
                prev_bev = self.encode(prev_imgs, prev_projs)
        bev = self.encode(imgs, projs, prev_bev)
        B = bev.shape[0]
        return self.head(bev.transpose(1, 2).reshape(B, -1, BEV, BEV))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.out, args.exp)

    train_ds = TemporalBEVData(args.dataroot, prepare_infos(args, "train", rank))
    val_ds = TemporalBEVData(args.dataroot, prepare_infos(args, "val", rank))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, collate_fn=collate, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), args.bs,
                        collate_fn=collate, num_workers=args.workers)

    net = BEVFormerT().to(dev)
    # the temporal block is skipped when a batch holds a scene's first keyframe
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * world * args.bs / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_dl))
    pos_w = torch.tensor([2.5, 1.0], device=dev).view(1, 2, 1, 1)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        wandb.init(project="bev-seg", name=args.exp, config=vars(args), dir=out_dir, resume="allow")

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, b in enumerate(train_dl):
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(b["imgs"], b["projs"], b.get("prev_imgs"), b.get("prev_projs"))
            loss = F.binary_cross_entropy_with_logits(logits.float(), b["label"], pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0], "epoch": epoch})

        net.eval()
        iu = torch.zeros(2, 2, device=dev)
        with torch.no_grad():
            for b in val_dl:
                b = {k: v.to(dev) for k, v in b.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = net(b["imgs"], b["projs"], b.get("prev_imgs"), b.get("prev_projs")).float().sigmoid() > 0.5
                gt = b["label"] > 0.5
                iu[0] += (pred & gt).sum((0, 2, 3))
                iu[1] += (pred | gt).sum((0, 2, 3))
        dist.all_reduce(iu)
        iou = (iu[0] / iu[1].clamp(min=1)).tolist()
        if rank == 0:
            wandb.log({"val/iou_vehicle": iou[0], "val/iou_drivable": iou[1], "epoch": epoch})
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(out_dir, "latest.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
