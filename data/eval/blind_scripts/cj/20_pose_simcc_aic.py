"""SimCC top-down pose (coordinate classification instead of heatmaps) on AI Challenger keypoints.

torchrun --nproc_per_node=8 20_pose_simcc_aic.py --cfg configs/simcc_convnext_t_aic_256x192.yaml
"""
import argparse
import json
import os

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AIC_SIGMAS = np.array([0.01388152, 0.01515228, 0.01057665, 0.01417709, 0.01497891, 0.01402144, 0.03909642,
                       0.03686941, 0.01981803, 0.03843971, 0.03412318, 0.02415081, 0.01291456, 0.01236173])
AIC_FLIP = [3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 7, 8, 12, 13]


def parse_args():
    parser = argparse.ArgumentParser(description="SimCC training")
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    for k, v in zip(args.opts[0::2], args.opts[1::2]):
        cfg[k] = yaml.safe_load(v)
    return args, cfg


class AICTopDown(Dataset):
    def __init__(self, ann_file, img_dir, cfg, train):
        self.coco = COCO(ann_file)
        self.img_dir, self.train = img_dir, train
        self.w, self.h = cfg["input_size"]
        self.split = cfg["simcc_split_ratio"]
        self.sigma = cfg["label_sigma"]
        self.recs = [a for a in self.coco.loadAnns(self.coco.getAnnIds(iscrowd=False))
                     if a["num_keypoints"] > 0 and a["bbox"][2] > 1 and a["bbox"][3] > 1]

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        a = self.recs[i]
        info = self.coco.loadImgs(a["image_id"])[0]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, info["file_name"])), cv2.COLOR_BGR2RGB)
        x, y, bw, bh = a["bbox"]
        c = np.array([x + bw / 2, y + bh / 2])
        s = max(bw, bh * self.w / self.h) * 1.25
        kp = np.array(a["keypoints"], np.float32).reshape(14, 3)
        rot = 0.0
        if self.train:
            s *= np.random.uniform(0.75, 1.25)
            rot = np.random.uniform(-60, 60) if np.random.rand() < 0.5 else 0.0
            if np.random.rand() < 0.5:
                img, kp = img[:, ::-1], kp[AIC_FLIP]
                c[0] = img.shape[1] - 1 - c[0]
                kp[:, 0] = img.shape[1] - 1 - kp[:, 0]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, self.w / s)
        M[:, 2] += (self.w / 2 - c[0], self.h / 2 - c[1])
        crop = cv2.warpAffine(np.ascontiguousarray(img), M, (self.w, self.h))
        pts = np.c_[kp[:, :2], np.ones(14)] @ M.T
        vis = ((kp[:, 2] > 0) & (pts[:, 0] >= 0) & (pts[:, 0] < self.w) & (pts[:, 1] >= 0) & (pts[:, 1] < self.h))
        bx = np.arange(int(self.w * self.split))
        by = np.arange(int(self.h * self.split))
        tx = np.exp(-((bx[None] - pts[:, :1] * self.split) ** 2) / (2 * (self.sigma[0] * self.split) ** 2))
        ty = np.exp(-((by[None] - pts[:, 1:2] * self.split) ** 2) / (2 * (self.sigma[1] * self.split) ** 2))
        tx /= tx.sum(1, keepdims=True)
        ty /= ty.sum(1, keepdims=True)
        crop = ((crop / 255.0 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)).astype(np.float32)
        meta = torch.tensor([c[0], c[1], s, a["image_id"], i], dtype=torch.float64)
        return (torch.from_numpy(crop.transpose(2, 0, 1).copy()), torch.from_numpy(tx.astype(np.float32)),
                torch.from_numpy(ty.astype(np.float32)), torch.from_numpy(vis.astype(np.float32)), meta)


class SimCCNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        w, h = cfg["input_size"]
        self.backbone = timm.create_model(cfg["backbone"], pretrained=True, features_only=True, out_indices=(3,))
        ch = self.backbone.feature_info.channels()[-1]
        fh, fw = h // 32, w // 32
        self.neck = nn.Sequential(nn.Conv2d(ch, 14, 7, padding=3), nn.Flatten(2))
        self.mlp = nn.Sequential(nn.Linear(fh * fw, 256), nn.GELU(), nn.LayerNorm(256))
        self.cls_x = nn.Linear(256, int(w * cfg["simcc_split_ratio"]))
        self.cls_y = nn.Linear(256, int(h * cfg["simcc_split_ratio"]))

    def forward(self, x):
        f = self.mlp(self.neck(self.backbone(x)[-1]))
        return self.cls_x(f), self.cls_y(f)


def simcc_kl(pred, target, vis, beta=10.0):
    logp = F.log_softmax(pred * beta, dim=-1)
    kl = (target * (torch.log(target.clamp(min=1e-12)) - logp)).sum(-1)
    return (kl * vis).sum() / vis.sum().clamp(min=1)


@torch.no_grad()
def evaluate(model, loader, coco, cfg, out_dir, device):
    model.eval()
    w = cfg["input_size"][0]
    ratio = cfg["simcc_split_ratio"]
    preds = []
    for img, _, _, _, meta in loader:
        lx, ly = model(img.to(device, non_blocking=True))
        px, py = lx.softmax(-1), ly.softmax(-1)
        sx, ix = px.max(-1)
        sy, iy = py.max(-1)
        xy = torch.stack([ix, iy], -1).float().cpu().numpy() / ratio
        score = torch.minimum(sx, sy).cpu().numpy()
        for k in range(img.size(0)):
            cx, cy, s, image_id, index = meta[k].tolist()
            img_xy = (xy[k] - [cfg["input_size"][0] / 2, cfg["input_size"][1] / 2]) * (s / w) + [cx, cy]
            preds.append({"index": int(index), "image_id": int(image_id), "category_id": 1,
                          "keypoints": np.c_[img_xy, score[k]].reshape(-1).tolist(), "score": float(score[k].mean())})
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, preds)
    ap = [0.0]
    if dist.get_rank() == 0:
        merged = {p["index"]: p for part in everything for p in part}
        path = os.path.join(out_dir, "aic_val_pred.json")
        with open(path, "w") as f:
            json.dump([{k: v for k, v in p.items() if k != "index"} for p in merged.values()], f)
        ev = COCOeval(coco, coco.loadRes(path), "keypoints")
        ev.params.kpt_oks_sigmas = AIC_SIGMAS
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        ap = [float(ev.stats[0])]
    dist.broadcast_object_list(ap, src=0)
    return ap[0]


def main():
    args, cfg = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_set = AICTopDown(cfg["train_ann"], cfg["train_img"], cfg, train=True)
    val_set = AICTopDown(cfg["val_ann"], cfg["val_img"], cfg, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg["workers"], pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCCNet(cfg)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg["lr_ref_batch"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.get("weight_decay", 0.05))
    total = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total, pct_start=0.02)

    out_dir = cfg["work_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(2, device=device)
        for img, tx, ty, vis, _ in train_loader:
            img = img.to(device, non_blocking=True)
            tx, ty, vis = tx.to(device), ty.to(device), vis.to(device)
            lx, ly = model(img)
            loss = simcc_kl(lx, tx, vis) + simcc_kl(ly, ty, vis)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {(meter[0] / meter[1]).item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                  flush=True)
        if (epoch + 1) % cfg["eval_interval"] == 0 or epoch + 1 == cfg["epochs"]:
            ap = evaluate(model.module, val_loader, val_set.coco, cfg, out_dir, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: AIC val AP {ap:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "ap": ap},
                           os.path.join(out_dir, "latest.pth"))
                if ap > best:
                    best = ap
                    torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "ap": ap},
                               os.path.join(out_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
