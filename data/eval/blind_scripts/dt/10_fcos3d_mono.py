"""FCOS3D monocular 3D detection on nuScenes (each camera image is one sample).

    torchrun --nproc_per_node=8 tools/train_fcos3d.py --data-root data/nuscenes \
        --work-dir work_dirs/fcos3d_r50_1x --samples-per-gpu 2
"""
import argparse
import logging
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
from torchvision.ops import FeaturePyramidNetwork

from av3d.models.heads import FCOSMono3DHead
from av3d.eval import nuscenes_evaluate_mono

CLASSES = ("car", "truck", "trailer", "bus", "construction_vehicle", "bicycle",
           "motorcycle", "pedestrian", "traffic_cone", "barrier")


def get_args():
    parser = argparse.ArgumentParser(description="FCOS3D training")
    parser.add_argument("--data-root", default="data/nuscenes")
    parser.add_argument("--work-dir", default="work_dirs/fcos3d")
    parser.add_argument("--samples-per-gpu", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class NuScenesMono(Dataset):
    """One item per (sample, camera) pair, from the mono3d COCO-style info file."""

    def __init__(self, root, ann_file, training):
        with open(os.path.join(root, ann_file), "rb") as f:
            data = pickle.load(f)
        self.images = data["images"]
        self.anns = data["annotations"]  # list aligned with images
        self.root = root
        self.training = training
        self.mean = np.array([103.530, 116.280, 123.675], np.float32)
        self.std = np.array([1.0, 1.0, 1.0], np.float32)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        im = self.images[i]
        img = np.asarray(Image.open(os.path.join(self.root, im["file_name"])).convert("RGB"), np.float32)[..., ::-1]
        img = (img - self.mean) / self.std
        K = np.array(im["cam_intrinsic"], np.float32)
        anns = self.anns[i]
        boxes3d = np.array([a["bbox_cam3d"] for a in anns], np.float32).reshape(-1, 7)
        vel = np.array([a["velo_cam3d"] for a in anns], np.float32).reshape(-1, 2)
        boxes2d = np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4)  # x y w h
        centers2d = np.array([a["center2d"][:2] for a in anns], np.float32).reshape(-1, 2)
        depths = np.array([a["center2d"][2] for a in anns], np.float32)
        labels = np.array([a["category_id"] for a in anns], np.int64)
        attrs = np.array([a["attribute_id"] for a in anns], np.int64)
        boxes2d[:, 2:] += boxes2d[:, :2]
        if self.training and np.random.rand() < 0.5:
            w = img.shape[1]
            img = img[:, ::-1]
            boxes2d[:, [0, 2]] = w - boxes2d[:, [2, 0]]
            centers2d[:, 0] = w - centers2d[:, 0]
            boxes3d[:, 0] = -boxes3d[:, 0]
            boxes3d[:, 6] = -boxes3d[:, 6] + np.pi
            vel[:, 0] = -vel[:, 0]
            K = K.copy()
            K[0, 2] = w - K[0, 2]
        pad_h, pad_w = (-img.shape[0]) % 32, (-img.shape[1]) % 32
        img = np.pad(img, ((0, pad_h), (0, pad_w), (0, 0)))
        return {
            "img": torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
            "cam2img": torch.from_numpy(K),
            "gt_bboxes": torch.from_numpy(boxes2d), "gt_bboxes_3d": torch.from_numpy(np.concatenate([boxes3d, vel], 1)),
            "gt_labels": torch.from_numpy(labels), "centers2d": torch.from_numpy(centers2d),
            "depths": torch.from_numpy(depths), "attr_labels": torch.from_numpy(attrs),
            "sample_token": im["token"], "cam": im["cam"], "img_id": i,
        }


def collate_mono(batch):
    out = {"img": torch.stack([b["img"] for b in batch]), "cam2img": torch.stack([b["cam2img"] for b in batch])}
    for k in ("gt_bboxes", "gt_bboxes_3d", "gt_labels", "centers2d", "depths", "attr_labels"):
        out[k] = [b[k] for b in batch]
    out["metas"] = [{"sample_token": b["sample_token"], "cam": b["cam"], "img_id": b["img_id"]} for b in batch]
    return out


class FCOS3D(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet101(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        for p in self.stem.parameters():
            p.requires_grad_(False)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.fpn = FeaturePyramidNetwork([512, 1024, 2048], 256)
        self.p6 = nn.Conv2d(256, 256, 3, 2, 1)
        self.p7 = nn.Conv2d(256, 256, 3, 2, 1)
        self.head = FCOSMono3DHead(num_classes=len(CLASSES), in_channels=256, strides=(8, 16, 32, 64, 128),
                                   num_attrs=9, norm="GN", pred_velo=True)

    def forward(self, img, cam2img):
        x = self.stem(img)
        feats = {}
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i > 0:
                feats[f"c{i + 2}"] = x
        p = list(self.fpn(feats).values())
        p6 = self.p6(p[-1])
        p7 = self.p7(F.relu(p6))
        return self.head(p + [p6, p7], cam2img)


def evaluate(model, loader, args, epoch, log):
    model.eval()
    results = []
    with torch.no_grad():
        for b in loader:
            out = model(b["img"].cuda(non_blocking=True), b["cam2img"].cuda(non_blocking=True))
            for meta, det in zip(b["metas"], model.module.head.get_bboxes(out, b["cam2img"].cuda())):
                results.append((meta, {k: v.cpu() for k, v in det.items()}))
    all_results = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, results)
    model.train()
    if dist.get_rank() == 0:
        dedup = {}
        for part in all_results:
            for meta, det in part:
                dedup[meta["img_id"]] = (meta, det)
        metrics = nuscenes_evaluate_mono(list(dedup.values()), CLASSES, args.data_root,
                                         os.path.join(args.work_dir, f"results_epoch{epoch}"))
        log.info("epoch %d  mAP %.4f  NDS %.4f", epoch, metrics["mAP"], metrics["NDS"])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    log = logging.getLogger("fcos3d")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(name)s - %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        log.addHandler(logging.FileHandler(os.path.join(args.work_dir, "train.log")))

    train_set = NuScenesMono(args.data_root, "nuscenes_infos_train_mono3d.coco.pkl", training=True)
    val_set = NuScenesMono(args.data_root, "nuscenes_infos_val_mono3d.coco.pkl", training=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.samples_per_gpu, sampler=train_sampler, num_workers=4,
                              collate_fn=collate_mono, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2, collate_fn=collate_mono, num_workers=4,
                            sampler=DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False))

    model = FCOS3D().cuda(args.local_rank)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)

    def lr_at(it):
        if it < 500:
            return 1.0 / 3 + (2.0 / 3) * it / 500
        return 0.1 if it >= 8 * iters_per_epoch else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)

    start_epoch = 0
    if args.resume_from:
        ck = torch.load(args.resume_from, map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            out = model(b["img"].cuda(non_blocking=True), b["cam2img"].cuda(non_blocking=True))
            gts = {k: [x.cuda(non_blocking=True) for x in b[k]]
                   for k in ("gt_bboxes", "gt_bboxes_3d", "gt_labels", "centers2d", "depths", "attr_labels")}
            losses = model.module.head.loss(out, **gts)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 35, norm_type=2)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                log.info("Epoch [%d][%d/%d] lr %.5f loss %.4f (%s) time %.3f", epoch + 1, it, iters_per_epoch,
                         optimizer.param_groups[0]["lr"], loss.item(),
                         ", ".join(f"{k}: {v.item():.4f}" for k, v in losses.items()), (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        dist.barrier()
        if epoch + 1 in (6, args.epochs):
            evaluate(model, val_loader, args, epoch + 1, log)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
