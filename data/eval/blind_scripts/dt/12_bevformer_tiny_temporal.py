"""BEVFormer-tiny (temporal) on nuScenes, with a lightweight in-loop evaluator.

The in-loop evaluator computes center-distance mAP and a simplified NDS
(mAP + ATE/ASE/AOE) directly from the val loader, which is much faster than
the devkit and good enough to pick the best epoch; the devkit numbers are
computed offline on the saved best checkpoint.

    torchrun --nproc_per_node=8 train_bevformer_tiny.py --data-root data/nuscenes --work-dir work_dirs/bevformer_tiny
"""
import argparse
import os
import pickle
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from av3d.models.bevformer import BEVFormerEncoder, Detr3DHead

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
CAMS = ["CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT"]
DIST_THS = [0.5, 1.0, 2.0, 4.0]


class TemporalNuScenes(Dataset):
    def __init__(self, root, split, queue_len=3, training=True, scale=0.5):
        with open(os.path.join(root, f"nuscenes_infos_temporal_{split}.pkl"), "rb") as f:
            self.infos = sorted(pickle.load(f)["infos"], key=lambda e: e["timestamp"])
        self.root, self.queue_len, self.training, self.scale = root, queue_len, training, scale
        self.to_tensor = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.infos)

    def load_frame(self, info):
        imgs, l2i = [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.root, c["data_path"])).convert("RGB")
            img = img.resize((int(img.width * self.scale), int(img.height * self.scale)))
            imgs.append(self.to_tensor(img))
            K = np.eye(4)
            K[:3, :3] = np.array(c["cam_intrinsic"]) * np.array([[self.scale], [self.scale], [1.0]])
            l2i.append(K @ np.linalg.inv(c["sensor2lidar"]))
        return torch.stack(imgs), torch.tensor(np.stack(l2i), dtype=torch.float32)

    def __getitem__(self, idx):
        info = self.infos[idx]
        hist_ids = list(range(max(0, idx - self.queue_len), idx))
        if self.training:
            random.shuffle(hist_ids)
            hist_ids = sorted(hist_ids[: self.queue_len - 1])
        hist = [self.infos[i] for i in hist_ids if self.infos[i]["scene_token"] == info["scene_token"]]
        frames = [self.load_frame(h) for h in hist] + [self.load_frame(info)]
        ego_motion = [torch.tensor(h["lidar2global"], dtype=torch.float32) for h in hist + [info]]
        keep = np.isin(info["gt_names"], CLASSES)
        return {
            "imgs": [f[0] for f in frames], "lidar2img": [f[1] for f in frames], "lidar2global": ego_motion,
            "gt_boxes": torch.tensor(info["gt_boxes"][keep], dtype=torch.float32),
            "gt_labels": torch.tensor([CLASSES.index(n) for n in info["gt_names"][keep]], dtype=torch.long),
            "token": info["token"],
        }


def collate_temporal(batch):
    return {k: [b[k] for b in batch] for k in batch[0]}


class BEVFormerTiny(nn.Module):
    def __init__(self, bev_hw=(50, 50), embed=256):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2,
                                      r50.layer3, r50.layer4)
        self.neck = nn.Conv2d(2048, embed, 1)
        self.encoder = BEVFormerEncoder(embed_dims=embed, bev_h=bev_hw[0], bev_w=bev_hw[1], num_layers=3,
                                        pc_range=[-51.2, -51.2, -5.0, 51.2, 51.2, 3.0], num_cams=len(CAMS))
        self.head = Detr3DHead(num_classes=len(CLASSES), embed_dims=embed, num_query=900, num_layers=6, code_size=10)

    def extract(self, imgs):
        f = self.neck(self.backbone(imgs))
        return f.view(1, len(CAMS), *f.shape[1:])

    def forward(self, imgs_seq, l2i_seq, l2g_seq):
        prev_bev = None
        with torch.no_grad():
            for t in range(len(imgs_seq) - 1):
                prev_bev = self.encoder(self.extract(imgs_seq[t]), l2i_seq[t], prev_bev,
                                        ego_motion=(l2g_seq[t - 1], l2g_seq[t]) if t > 0 else None)
        ego = (l2g_seq[-2], l2g_seq[-1]) if len(l2g_seq) > 1 else None
        bev = self.encoder(self.extract(imgs_seq[-1]), l2i_seq[-1], prev_bev, ego_motion=ego)
        return self.head(bev)


def center_distance_metrics(preds, gts):
    """preds/gts: token -> dict(boxes (N,9), scores, labels). Returns mAP and TP errors."""
    aps, tp_err = [], defaultdict(list)
    for c in range(len(CLASSES)):
        dets = [(tok, b, s) for tok, p in preds.items()
                for b, s, l in zip(p["boxes"], p["scores"], p["labels"]) if l == c]
        dets.sort(key=lambda x: -x[2])
        gt_c = {tok: g["boxes"][g["labels"] == c] for tok, g in gts.items()}
        npos = sum(len(v) for v in gt_c.values())
        if npos == 0:
            continue
        for th in DIST_THS:
            used = {tok: np.zeros(len(v), bool) for tok, v in gt_c.items()}
            tp = []
            for tok, b, _ in dets:
                g = gt_c.get(tok, np.zeros((0, 9)))
                if len(g) == 0:
                    tp.append(0)
                    continue
                d = np.linalg.norm(g[:, :2] - b[:2], axis=1)
                d[used[tok]] = np.inf
                j = int(np.argmin(d))
                if d[j] < th:
                    used[tok][j] = True
                    tp.append(1)
                    if th == 2.0:
                        tp_err["ate"].append(d[j])
                        tp_err["ase"].append(1 - np.prod(np.minimum(b[3:6], g[j, 3:6])) / np.prod(np.maximum(b[3:6], g[j, 3:6])))
                        tp_err["aoe"].append(abs((b[6] - g[j, 6] + np.pi) % (2 * np.pi) - np.pi))
                else:
                    tp.append(0)
            tp = np.array(tp)
            prec = np.cumsum(tp) / np.arange(1, len(tp) + 1) if len(tp) else np.zeros(1)
            rec = np.cumsum(tp) / npos if len(tp) else np.zeros(1)
            rs = np.linspace(0.1, 1, 91)
            aps.append(np.mean([prec[rec >= r].max() if np.any(rec >= r) else 0.0 for r in rs]))
    mAP = float(np.mean(aps)) if aps else 0.0
    errs = {k: float(np.mean(v)) if v else 1.0 for k, v in tp_err.items()}
    nds = (5 * mAP + sum(1 - min(1.0, errs.get(k, 1.0)) for k in ("ate", "ase", "aoe"))) / 8
    return {"mAP": mAP, "NDS*": nds, **errs}


@torch.no_grad()
def validate(model, loader):
    model.eval()
    preds, gts = {}, {}
    for b in loader:
        for i, tok in enumerate(b["token"]):
            imgs = [x.cuda(non_blocking=True) for x in b["imgs"][i]]
            l2i = [x.cuda() for x in b["lidar2img"][i]]
            l2g = [x.cuda() for x in b["lidar2global"][i]]
            det = model.module.head.get_bboxes(model(imgs, l2i, l2g))[0]
            preds[tok] = {k: v.cpu().numpy() for k, v in det.items()}
            gts[tok] = {"boxes": b["gt_boxes"][i].numpy(), "labels": b["gt_labels"][i].numpy()}
    model.train()
    return center_distance_metrics(preds, gts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", default="work_dirs/bevformer_tiny")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_set = TemporalNuScenes(args.data_root, "train", training=True)
    val_set = TemporalNuScenes(args.data_root, "val", training=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=4, collate_fn=collate_temporal,
                              pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, collate_fn=collate_temporal)

    model = DDP(BEVFormerTiny().cuda(), device_ids=[local_rank])
    optim = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if "backbone" in n], "lr": args.lr * 0.1},
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n]}], lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs * len(train_loader), eta_min=args.lr * 1e-3)

    best_nds = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            imgs = [x.cuda(non_blocking=True) for x in b["imgs"][0]]
            l2i = [x.cuda() for x in b["lidar2img"][0]]
            l2g = [x.cuda() for x in b["lidar2global"][0]]
            out = model(imgs, l2i, l2g)
            losses = model.module.head.loss(out, [b["gt_boxes"][0].cuda()], [b["gt_labels"][0].cuda()])
            loss = sum(losses.values())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            optim.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[1]:.2e} {(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        metrics = validate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch + 1}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "metrics": metrics},
                       os.path.join(args.work_dir, "latest.pth"))
            if metrics["NDS*"] > best_nds:
                best_nds = metrics["NDS*"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "metrics": metrics},
                           os.path.join(args.work_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
