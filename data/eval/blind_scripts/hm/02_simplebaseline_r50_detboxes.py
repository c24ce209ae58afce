"""SimpleBaseline (ResNet-50 + deconv head) top-down pose training.

Validation runs on the person detections (COCO val2017 detector boxes, AP 56.4),
the predictions of every rank are collected on rank 0 for the COCO OKS evaluation.
"""
import argparse
import json
import math
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from pose_utils.transforms import get_affine_transform, affine_transform, fliplr_joints, flip_back
from pose_utils.targets import gaussian_heatmaps
from pose_utils.nms import oks_nms

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--coco", default="/data/coco")
    p.add_argument("--det-file", default="/data/coco/person_detection_results/COCO_val2017_detections_AP_H_56_person.json")
    p.add_argument("--out", default="work_dirs/simplebaseline_r50_256x192")
    p.add_argument("--input-size", type=int, nargs=2, default=[192, 256])
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=10)
    return p.parse_args()


class TopDownCOCO(Dataset):
    def __init__(self, coco, img_dir, input_size, train, det_file=None, det_thr=0.0):
        self.coco, self.img_dir, self.train = coco, img_dir, train
        self.w, self.h = input_size
        self.samples = []
        if det_file is None:
            for ann in coco.loadAnns(coco.getAnnIds(catIds=[1], iscrowd=False)):
                if ann["num_keypoints"] == 0:
                    continue
                self.samples.append((ann["image_id"], ann["bbox"], np.array(ann["keypoints"], np.float32).reshape(17, 3), 1.0))
        else:
            for det in json.load(open(det_file)):
                if det["category_id"] == 1 and det["score"] > det_thr:
                    self.samples.append((det["image_id"], det["bbox"], np.zeros((17, 3), np.float32), det["score"]))

    def __len__(self):
        return len(self.samples)

    def box_to_cs(self, box):
        x, y, w, h = box
        c = np.array([x + w / 2, y + h / 2], np.float32)
        ratio = self.w / self.h
        if w > ratio * h:
            h = w / ratio
        else:
            w = h * ratio
        return c, np.array([w, h], np.float32) / 200.0 * 1.25

    def __getitem__(self, i):
        img_id, box, kps, score = self.samples[i]
        fname = self.coco.loadImgs(img_id)[0]["file_name"]
        img = cv2.imread(os.path.join(self.img_dir, fname))[:, :, ::-1]
        c, s = self.box_to_cs(box)
        joints, vis = kps[:, :2].copy(), (kps[:, 2:] > 0).astype(np.float32).repeat(2, 1)
        rot = 0.0
        if self.train:
            s = s * np.clip(np.random.randn() * 0.3 + 1, 0.7, 1.3)
            rot = np.clip(np.random.randn() * 40, -80, 80) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                c[0] = img.shape[1] - c[0] - 1
        trans = get_affine_transform(c, s, rot, (self.w, self.h))
        crop = cv2.warpAffine(np.ascontiguousarray(img), trans, (self.w, self.h), flags=cv2.INTER_LINEAR)
        for k in range(17):
            if vis[k, 0] > 0:
                joints[k] = affine_transform(joints[k], trans)
        heatmaps, weights = gaussian_heatmaps(joints, vis[:, 0], (self.w // 4, self.h // 4), stride=4, sigma=2)
        crop = ((crop.astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)
        meta = np.array([c[0], c[1], s[0], s[1], score, img_id], dtype=np.float64)
        return torch.from_numpy(crop), torch.from_numpy(heatmaps), torch.from_numpy(weights), torch.from_numpy(meta)


class PoseResNet(nn.Module):
    def __init__(self, num_joints=17, deconv_ch=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        layers, in_ch = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(in_ch, deconv_ch, 4, 2, 1, bias=False), nn.BatchNorm2d(deconv_ch), nn.ReLU(True)]
            in_ch = deconv_ch
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(deconv_ch, num_joints, 1)
        for m in self.deconv.modules():
            if isinstance(m, nn.ConvTranspose2d):
                nn.init.normal_(m.weight, std=0.001)
        nn.init.normal_(self.final.weight, std=0.001)
        nn.init.zeros_(self.final.bias)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)))


def heatmap_to_coords(hm, meta):
    """Argmax + quarter offset, back to image coordinates."""
    b, k, h, w = hm.shape
    flat = hm.reshape(b, k, -1)
    maxvals, idx = flat.max(dim=2)
    x = (idx % w).float()
    y = (idx // w).float()
    xi, yi = x.long().clamp(1, w - 2), y.long().clamp(1, h - 2)
    bi = torch.arange(b, device=hm.device)[:, None]
    ki = torch.arange(k, device=hm.device)[None, :]
    dx = hm[bi, ki, yi, xi + 1] - hm[bi, ki, yi, xi - 1]
    dy = hm[bi, ki, yi + 1, xi] - hm[bi, ki, yi - 1, xi]
    x = x + 0.25 * torch.sign(dx)
    y = y + 0.25 * torch.sign(dy)
    center, scale = meta[:, None, 0:2].float(), meta[:, None, 2:4].float() * 200.0
    px = x / w * scale[..., 0] + center[..., 0] - scale[..., 0] * 0.5
    py = y / h * scale[..., 1] + center[..., 1] - scale[..., 1] * 0.5
    return torch.stack([px, py, maxvals], dim=2)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    all_kpts, all_meta = [], []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = net(img)
        hm_f = flip_back(net(img.flip(3)), FLIP_PAIRS)
        hm_f[..., 1:] = hm_f[..., :-1].clone()
        hm = (hm + hm_f) / 2
        all_kpts.append(heatmap_to_coords(hm, meta.to(device)))
        all_meta.append(meta.to(device))
    kpts = torch.cat(all_kpts)
    meta = torch.cat(all_meta)

    world = dist.get_world_size()
    kpts_list = [torch.empty_like(kpts) for _ in range(world)]
    meta_list = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(kpts_list, kpts)
    dist.all_gather(meta_list, meta)
    return torch.cat(kpts_list).cpu().numpy(), torch.cat(meta_list).cpu().numpy()


def coco_ap(coco, kpts, meta, out_file):
    per_image = {}
    for k, m in zip(kpts, meta):
        valid = k[:, 2] > 0.2
        kscore = k[valid, 2].mean() if valid.any() else 0.0
        area = (m[2] * 200) * (m[3] * 200)
        per_image.setdefault(int(m[5]), []).append(dict(keypoints=k, score=float(m[4] * kscore), area=area))
    results = []
    for img_id, persons in per_image.items():
        keep = oks_nms(persons, 0.9)
        for i in keep:
            results.append(dict(image_id=img_id, category_id=1,
                                keypoints=persons[i]["keypoints"].reshape(-1).tolist(), score=persons[i]["score"]))
    with open(out_file, "w") as f:
        json.dump(results, f)
    ev = COCOeval(coco, coco.loadRes(out_file), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    coco_train = COCO(os.path.join(args.coco, "annotations/person_keypoints_train2017.json"))
    coco_val = COCO(os.path.join(args.coco, "annotations/person_keypoints_val2017.json"))
    train_set = TopDownCOCO(coco_train, os.path.join(args.coco, "train2017"), args.input_size, train=True)
    val_set = TopDownCOCO(coco_val, os.path.join(args.coco, "val2017"), args.input_size, train=False, det_file=args.det_file)

    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    # strided shard of the detections: every box is evaluated exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, 64, shuffle=False, num_workers=args.workers, pin_memory=True)

    net = PoseResNet().to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    warmup = 500
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda it: min(1.0, (it + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * it / total)))

    writer = SummaryWriter(args.out) if rank == 0 else None
    os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for img, hm, w, _ in train_loader:
            img, hm, w = img.to(device, non_blocking=True), hm.to(device, non_blocking=True), w.to(device, non_blocking=True)
            pred = model(img)
            loss = (((pred - hm) ** 2) * w[..., None, None]).mean() * 0.5
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - tic:.0f}s, loss {loss.item():.6f}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            kpts, meta = evaluate(model.module, val_loader, device)
            if rank == 0:
                stats = coco_ap(coco_val, kpts, meta, os.path.join(args.out, f"val_results_{epoch}.json"))
                writer.add_scalar("val/AP", stats[0], epoch)
                writer.add_scalar("val/AP50", stats[1], epoch)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict(),
                            "sched": sched.state_dict()}, os.path.join(args.out, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
