"""HRNet-W32 256x192 top-down keypoint training on COCO with OKS AP validation.

torchrun --nnodes=1 --nproc_per_node=8 10_pose_hrnet_w32_coco.py --work-dir work_dirs/hrnet_w32_256x192
"""
import argparse
import copy
import json
import logging
import os
import os.path as osp

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CFG = dict(
    data_root="/data/coco",
    input_size=(192, 256),
    heatmap_size=(48, 64),
    sigma=2,
    samples_per_gpu=32,
    workers_per_gpu=4,
    lr=5e-4,           # Adam, 8 GPUs x 32
    total_epochs=210,
    lr_steps=(170, 200),
    warmup_iters=500,
    val_interval=10,
)
FLIP_INDEX = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]
logger = logging.getLogger("pose")


def crop(img, center, scale, rot, size):
    M = cv2.getRotationMatrix2D((float(center[0]), float(center[1])), rot, size[0] / scale[0])
    M[:, 2] += np.array(size, np.float64) / 2 - center
    return cv2.warpAffine(img, M, size, flags=cv2.INTER_LINEAR), M


class COCOKeypoints(Dataset):
    def __init__(self, root, split, cfg, test_mode=False):
        self.coco = COCO(osp.join(root, "annotations", f"person_keypoints_{split}.json"))
        self.img_prefix = osp.join(root, split)
        self.cfg, self.test_mode = cfg, test_mode
        self.samples = []
        for ann in self.coco.loadAnns(self.coco.getAnnIds(iscrowd=False)):
            if max(ann["keypoints"][2::3]) == 0 or ann["bbox"][2] < 1 or ann["bbox"][3] < 1:
                continue
            x, y, w, h = ann["bbox"]
            aspect = cfg["input_size"][0] / cfg["input_size"][1]
            w, h = (h * aspect, h) if w < h * aspect else (w, w / aspect)
            self.samples.append(dict(image_id=ann["image_id"], center=np.array([x + ann["bbox"][2] / 2, y + ann["bbox"][3] / 2]),
                                     scale=np.array([w, h]) * 1.25,
                                     kpts=np.array(ann["keypoints"], np.float32).reshape(17, 3)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        s = copy.deepcopy(self.samples[idx])
        info = self.coco.loadImgs(s["image_id"])[0]
        img = cv2.imread(osp.join(self.img_prefix, info["file_name"]))[:, :, ::-1]
        rot = 0.0
        if not self.test_mode:
            s["scale"] = s["scale"] * np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            if np.random.rand() < 0.6:
                rot = float(np.clip(np.random.randn() * 40, -80, 80))
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                s["center"][0] = img.shape[1] - 1 - s["center"][0]
                s["kpts"] = s["kpts"][FLIP_INDEX]
                s["kpts"][:, 0] = img.shape[1] - 1 - s["kpts"][:, 0]
        patch, M = crop(np.ascontiguousarray(img), s["center"], s["scale"], rot, self.cfg["input_size"])
        hw, hh = self.cfg["heatmap_size"]
        pts = (np.c_[s["kpts"][:, :2], np.ones(17)] @ M.T) * hw / self.cfg["input_size"][0]
        xs, ys = np.arange(hw), np.arange(hh)[:, None]
        target = np.zeros((17, hh, hw), np.float32)
        tw = (s["kpts"][:, 2:3] > 0).astype(np.float32)
        for j in range(17):
            if tw[j] and 0 <= pts[j, 0] < hw and 0 <= pts[j, 1] < hh:
                target[j] = np.exp(-((xs - pts[j, 0]) ** 2 + (ys - pts[j, 1]) ** 2) / (2 * self.cfg["sigma"] ** 2))
            else:
                tw[j] = 0
        patch = ((patch / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32)
        meta = np.array([s["center"][0], s["center"][1], s["scale"][0], s["scale"][1], s["image_id"]], np.float64)
        return torch.from_numpy(patch.transpose(2, 0, 1).copy()), torch.from_numpy(target), torch.from_numpy(tw), meta


class HRNetPose(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        ch = self.backbone.feature_info.channels()[0]
        self.head = nn.Conv2d(ch, 17, kernel_size=1)

    def forward(self, x):
        return self.head(self.backbone(x)[0])


@torch.no_grad()
def evaluate(model, loader, coco, cfg, device):
    model.eval()
    results = []
    hw, hh = cfg["heatmap_size"]
    for img, _, _, meta in loader:
        img = img.to(device)
        heat = model(img) + model(img.flip(3)).flip(3)[:, FLIP_INDEX]
        n = heat.size(0)
        score, idx = heat.view(n, 17, -1).max(2)
        coords = torch.stack([idx % hw, idx // hw], -1).float().cpu().numpy()
        score = (score / 2).cpu().numpy()
        for i in range(n):
            cx, cy, sw, sh, image_id = meta[i].tolist()
            xy = (coords[i] / [hw, hh] - 0.5) * [sw, sh] + [cx, cy]
            results.append(dict(image_id=int(image_id), category_id=1, score=float(score[i].mean()),
                                keypoints=np.c_[xy, score[i]].reshape(-1).tolist()))
    coco_dt = coco.loadRes(results)
    ev = COCOeval(coco, coco_dt, "keypoints")
    ev.params.imgIds = sorted({r["image_id"] for r in results})
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return dict(AP=ev.stats[0], AP50=ev.stats[1], AP75=ev.stats[2], AR=ev.stats[5])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", default="work_dirs/hrnet_w32_256x192")
    args = parser.parse_args()
    cfg = CFG

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(message)s", level=logging.INFO if rank == 0 else logging.WARN)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        with open(osp.join(args.work_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    train_set = COCOKeypoints(cfg["data_root"], "train2017", cfg)
    val_set = COCOKeypoints(cfg["data_root"], "val2017", cfg, test_mode=True)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers_per_gpu"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg["workers_per_gpu"])

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetPose()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg["lr"] * world * cfg["samples_per_gpu"] / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def lr_lambda(it):
        epoch = it // len(train_loader)
        warm = min(1.0, 0.001 + it / cfg["warmup_iters"])
        return warm * 0.1 ** sum(epoch >= s for s in cfg["lr_steps"])

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    criterion = nn.MSELoss(reduction="none")

    best_ap = 0.0
    for epoch in range(cfg["total_epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (img, target, tw, _) in enumerate(train_loader):
            img, target, tw = img.to(device, non_blocking=True), target.to(device), tw.to(device)
            out = model(img)
            loss = (criterion(out, target).mean(dim=(2, 3)) * tw).mean() * 0.5
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                logged = loss.detach()
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                logger.info("Epoch [%d][%d/%d] lr %.3e loss %.6f", epoch + 1, i, len(train_loader),
                            optimizer.param_groups[0]["lr"], logged.item())

        if (epoch + 1) % cfg["val_interval"] == 0:
            metrics = evaluate(model.module, val_loader, val_set.coco, cfg, device)
            if rank == 0:
                logger.info("Epoch %d val: %s", epoch + 1, json.dumps({k: round(float(v), 4) for k, v in metrics.items()}))
                ckpt = dict(state_dict=model.module.state_dict(), epoch=epoch + 1, meta=metrics)
                torch.save(ckpt, osp.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
                if metrics["AP"] > best_ap:
                    best_ap = metrics["AP"]
                    torch.save(ckpt, osp.join(args.work_dir, "best_AP.pth"))
                    logger.info("new best AP %.4f at epoch %d", best_ap, epoch + 1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
