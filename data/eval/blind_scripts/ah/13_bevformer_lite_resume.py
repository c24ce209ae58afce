"""BEVFormer-lite: BEV queries sample multi-camera features at projected pillar points, DETR-style 3D box head.
nuScenes, 10 classes, single frame (no temporal self-attention).

    bash tools/dist_train.sh 8 --data-root data/nuscenes --load-from ckpts/r101_dcn_fcos3d_pretrain.pth
    bash tools/dist_train.sh 8 --data-root data/nuscenes --resume work_dirs/bevformer_lite/epoch_12.pth
(dist_train.sh = torchrun --nproc_per_node=$1 tools/train_bevformer_lite.py "${@:2}")
"""
import argparse
import logging
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle", "bicycle",
           "pedestrian", "traffic_cone"]
PC_RANGE = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]
BEV_H = BEV_W = 50
IMG_H, IMG_W = 450, 800
logger = logging.getLogger("bevformer")


class NuScenesMultiView(Dataset):
    def __init__(self, root, info_file, train):
        with open(os.path.join(root, info_file), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.root, self.train = root, train
        self.tf = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        imgs, l2i = [], []
        for cam, c in info["cams"].items():
            img = Image.open(os.path.join(self.root, c["data_path"])).convert("RGB")
            s = IMG_W / img.width
            imgs.append(self.tf(img.resize((IMG_W, IMG_H))))
            K = np.eye(4, dtype=np.float32)
            K[:3, :3] = np.array(c["cam_intrinsic"]) * np.array([[s], [s], [1]])
            R, t = c["sensor2lidar_rotation"], c["sensor2lidar_translation"]
            l2c = np.eye(4, dtype=np.float32)
            l2c[:3, :3], l2c[:3, 3] = R.T, -R.T @ t
            l2i.append(K @ l2c)
        keep = np.isin(info["gt_names"], CLASSES)
        boxes = np.concatenate([info["gt_boxes"][keep], np.nan_to_num(info["gt_velocity"][keep])], 1)
        labels = np.array([CLASSES.index(n) for n in info["gt_names"][keep]], np.int64)
        return {"imgs": torch.stack(imgs), "lidar2img": torch.from_numpy(np.stack(l2i)).float(),
                "boxes": torch.from_numpy(boxes).float(), "labels": torch.from_numpy(labels),
                "token": info["token"]}


def collate(batch):
    return {"imgs": torch.stack([b["imgs"] for b in batch]),
            "lidar2img": torch.stack([b["lidar2img"] for b in batch]),
            "boxes": [b["boxes"] for b in batch], "labels": [b["labels"] for b in batch],
            "tokens": [b["token"] for b in batch]}


class SpatialCrossAttn(nn.Module):
    def __init__(self, dim=256, n_z=4):
        super().__init__()
        xs = torch.linspace(PC_RANGE[0], PC_RANGE[3], BEV_W)
        ys = torch.linspace(PC_RANGE[1], PC_RANGE[4], BEV_H)
        zs = torch.linspace(-3.0, 2.0, n_z)
        g = torch.stack(torch.meshgrid(ys, xs, zs, indexing="ij"), -1)[..., [1, 0, 2]]
        self.register_buffer("ref3d", torch.cat([g, torch.ones_like(g[..., :1])], -1).view(-1, n_z, 4),
                             persistent=False)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, q, feats, l2i):
        B, N, C, h, w = feats.shape
        p = torch.einsum("bnij,qzj->bnqzi", l2i, self.ref3d)
        d = p[..., 2:3]
        uv = p[..., :2] / d.clamp(min=1e-5)
        uv = torch.stack([uv[..., 0] / IMG_W, uv[..., 1] / IMG_H], -1) * 2 - 1
        hit = ((d[..., 0] > 1e-5) & (uv.abs() < 1).all(-1)).float()  # B N Q Z
        s = F.grid_sample(feats.flatten(0, 1), uv.flatten(0, 1), align_corners=False)  # BN C Q Z
        s = s.view(B, N, C, -1, uv.shape[3]) * hit[:, :, None]
        agg = s.sum((1, 4)) / hit.sum((1, 3)).clamp(min=1)[:, None]
        return self.norm(q + self.proj(agg.transpose(1, 2)))


class BEVFormerLite(nn.Module):
    def __init__(self, dim=256, num_queries=600, layers=3):
        super().__init__()
        r = torchvision.models.resnet50(weights=None)
        self.backbone = nn.Sequential(*list(r.children())[:-3])
        self.neck = nn.Conv2d(1024, dim, 1)
        self.bev_embed = nn.Embedding(BEV_H * BEV_W, dim)
        self.bev_pos = nn.Parameter(torch.randn(1, BEV_H * BEV_W, dim) * 0.02)
        self.sca = nn.ModuleList([SpatialCrossAttn(dim) for _ in range(layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, dim))
                                  for _ in range(layers)])
        self.query = nn.Embedding(num_queries, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 512, batch_first=True), 3)
        self.cls_head = nn.Linear(dim, len(CLASSES))
        self.reg_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 10))

    def forward(self, imgs, l2i):
        B, N = imgs.shape[:2]
        f = self.neck(self.backbone(imgs.flatten(0, 1)))
        f = f.view(B, N, *f.shape[1:])
        bev = self.bev_embed.weight[None].expand(B, -1, -1) + self.bev_pos
        for sca, ffn in zip(self.sca, self.ffn):
            bev = sca(bev, f, l2i)
            bev = bev + ffn(bev)
        hs = self.decoder(self.query.weight[None].expand(B, -1, -1), bev)
        reg = self.reg_head(hs)
        reg = torch.cat([reg[..., :3].sigmoid(), reg[..., 3:]], -1)
        return self.cls_head(hs), reg


def encode_boxes(b):
    lo, hi = b.new_tensor(PC_RANGE[:3]), b.new_tensor(PC_RANGE[3:])
    return torch.cat([(b[:, :3] - lo) / (hi - lo), b[:, 3:6].log(), b[:, 6:7].sin(), b[:, 6:7].cos(), b[:, 7:9]], 1)


def set_criterion(cls_logits, reg, gt_boxes, gt_labels):
    loss_cls, loss_reg, n = 0.0, reg.sum() * 0.0, 0
    for b in range(cls_logits.shape[0]):
        tgt_cls = torch.zeros_like(cls_logits[b])
        if len(gt_labels[b]):
            tb = encode_boxes(gt_boxes[b])
            with torch.no_grad():
                cost = -cls_logits[b].sigmoid()[:, gt_labels[b]] * 2.0 + 0.25 * torch.cdist(reg[b, :, :3], tb[:, :3], p=1)
                qi, gi = linear_sum_assignment(cost.float().cpu().numpy())
            qi, gi = torch.as_tensor(qi, device=reg.device), torch.as_tensor(gi, device=reg.device)
            tgt_cls[qi, gt_labels[b][gi]] = 1.0
            loss_reg = loss_reg + F.l1_loss(reg[b, qi], tb[gi], reduction="sum")
            n += len(gi)
        loss_cls = loss_cls + torchvision.ops.sigmoid_focal_loss(cls_logits[b], tgt_cls, reduction="sum")
    n = max(n, 1)
    return 2.0 * loss_cls / n + 0.25 * loss_reg / n


@torch.no_grad()
def evaluate(model, loader, device, thr=2.0):
    model.eval()
    local = []
    for batch in loader:
        cls, reg = model(batch["imgs"].to(device), batch["lidar2img"].to(device))
        scores, labels = cls.sigmoid().max(-1)
        lo, hi = reg.new_tensor(PC_RANGE[:2]), reg.new_tensor(PC_RANGE[3:5])
        xy = reg[..., :2] * (hi - lo) + lo
        for b in range(len(batch["tokens"])):
            local.append((xy[b].cpu().numpy(), scores[b].cpu().numpy(), labels[b].cpu().numpy(),
                          batch["boxes"][b][:, :2].numpy(), batch["labels"][b].numpy()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    res = [r for g in gathered for r in g]
    aps = []
    for c in range(len(CLASSES)):
        recs, npos = [], 0
        for pxy, ps, pl, gxy, gl in res:
            g = gxy[gl == c]
            npos += len(g)
            used = np.zeros(len(g), bool)
            m = pl == c
            for j in np.argsort(-ps[m]):
                tp = 0
                if len(g):
                    d = np.linalg.norm(g - pxy[m][j], axis=1)
                    d[used] = np.inf
                    k = d.argmin()
                    if d[k] < thr:
                        used[k], tp = True, 1
                recs.append((ps[m][j], tp))
        if npos:
            recs.sort(key=lambda r: -r[0])
            tp = np.cumsum([r[1] for r in recs])
            prec, rec = tp / np.arange(1, len(recs) + 1), tp / npos
            aps.append(np.mean([prec[rec >= t].max() if (rec >= t).any() else 0 for t in np.linspace(0.1, 1, 10)]))
    return float(np.mean(aps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", default="work_dirs/bevformer_lite")
    ap.add_argument("--load-from", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--samples-per-gpu", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s - %(message)s")
    torch.manual_seed(0)

    train_ds = NuScenesMultiView(args.data_root, "nuscenes_infos_temporal_train.pkl", True)
    val_ds = NuScenesMultiView(args.data_root, "nuscenes_infos_temporal_val.pkl", False)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.samples_per_gpu, sampler=sampler, num_workers=4, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=4,
                        collate_fn=collate)

    model = BEVFormerLite().to(device)
    if args.load_from:
        state = torch.load(args.load_from, map_location="cpu")
        state = {k.replace("img_backbone.", "backbone."): v for k, v in state.get("state_dict", state).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        logger.info("load_from %s: %d missing, %d unexpected", args.load_from, len(missing), len(unexpected))
    model = DDP(model, device_ids=[local_rank])

    backbone_ids = {id(p) for p in model.module.backbone.parameters()}
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if id(p) in backbone_ids], "lr": args.lr * 0.1},
        {"params": [p for p in model.parameters() if id(p) not in backbone_ids]}], lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_dl), eta_min=args.lr * 1e-3)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["state_dict"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["lr_scheduler"])
        start_epoch = checkpoint["epoch"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_dl):
            cls, reg = model(batch["imgs"].to(device, non_blocking=True),
                             batch["lidar2img"].to(device, non_blocking=True))
            gt_boxes = [b.to(device) for b in batch["boxes"]]
            gt_labels = [l.to(device) for l in batch["labels"]]
            loss = set_criterion(cls, reg, gt_boxes, gt_labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            opt.step()
            sched.step()
            if it % 50 == 0:
                logger.info("Epoch [%d][%d/%d] lr: %.3e loss: %.4f", epoch + 1, it, len(train_dl),
                            opt.param_groups[1]["lr"], loss.item())

        if rank == 0:
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "lr_scheduler": sched.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            mAP = evaluate(model.module, val_dl, device)
            if rank == 0:
                logger.info("Epoch %d: center-distance mAP %.4f", epoch + 1, mAP)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
