"""BEVDet-R50 (camera only) on nuScenes.

torchrun --nproc_per_node=8 tools/bevdet_train.py --work-dir work_dirs/bevdet_r50_cbgs --epochs 24
"""
import argparse
import glob
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

from av3d.models.view_transform import LSSViewTransformer
from av3d.models.heads import CenterHead
from av3d.datasets.samplers import CBGSIndex
from av3d.eval import nuscenes_evaluate

CAMS = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
CLASSES = ("car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone")
FINAL_DIM = (256, 704)

logger = logging.getLogger("bevdet")


def img_transform(img, resize, crop, flip, rotate):
    ida = torch.eye(3)
    img = img.resize((int(img.width * resize), int(img.height * resize)), Image.BILINEAR)
    img = img.crop(crop)
    ida[:2, :2] *= resize
    ida[:2, 2] -= torch.tensor(crop[:2], dtype=torch.float32)
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
        A = torch.tensor([[-1.0, 0.0, crop[2] - crop[0]], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        ida = A @ ida
    img = img.rotate(rotate)
    th = rotate / 180 * np.pi
    R = torch.tensor([[np.cos(th), np.sin(th)], [-np.sin(th), np.cos(th)]], dtype=torch.float32)
    c = torch.tensor([FINAL_DIM[1] / 2, FINAL_DIM[0] / 2])
    ida[:2, :2] = R @ ida[:2, :2]
    ida[:2, 2] = R @ (ida[:2, 2] - c) + c
    return img, ida


class BEVDetDataset(Dataset):
    def __init__(self, root, split, training):
        with open(os.path.join(root, f"bevdetv2-nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.root = root
        self.training = training
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.infos)

    def sample_aug(self, H, W):
        if self.training:
            resize = np.random.uniform(0.38, 0.55)
            nh, nw = int(H * resize), int(W * resize)
            top = int((1 - np.random.uniform(0.0, 0.0)) * nh) - FINAL_DIM[0]
            left = int(np.random.uniform(0, max(0, nw - FINAL_DIM[1])))
            return resize, (left, top, left + FINAL_DIM[1], top + FINAL_DIM[0]), np.random.rand() < 0.5, \
                np.random.uniform(-5.4, 5.4)
        resize = 0.44 + 0.04
        nh, nw = int(H * resize), int(W * resize)
        top, left = nh - FINAL_DIM[0], (nw - FINAL_DIM[1]) // 2
        return resize, (left, top, left + FINAL_DIM[1], top + FINAL_DIM[0]), False, 0.0

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, rots, trans, intrins, idas = [], [], [], [], []
        for cam in CAMS:
            cinfo = info["cams"][cam]
            img = Image.open(os.path.join(self.root, cinfo["data_path"]))
            resize, crop, flip, rot = self.sample_aug(img.height, img.width)
            img, ida = img_transform(img, resize, crop, flip, rot)
            imgs.append(self.norm(torchvision.transforms.functional.to_tensor(img)))
            rots.append(torch.tensor(cinfo["sensor2ego_rotation_matrix"], dtype=torch.float32))
            trans.append(torch.tensor(cinfo["sensor2ego_translation"], dtype=torch.float32))
            intrins.append(torch.tensor(cinfo["cam_intrinsic"], dtype=torch.float32))
            idas.append(ida)
        mask = np.isin(info["gt_names"], CLASSES)
        boxes = torch.tensor(info["gt_boxes"][mask], dtype=torch.float32)
        labels = torch.tensor([CLASSES.index(n) for n in info["gt_names"][mask]], dtype=torch.long)
        bda = torch.eye(3)
        if self.training:
            ang = np.random.uniform(-22.5, 22.5) / 180 * np.pi
            sc = np.random.uniform(0.95, 1.05)
            c, s = np.cos(ang), np.sin(ang)
            bda = torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=torch.float32) * sc
            if np.random.rand() < 0.5:
                bda = torch.diag(torch.tensor([1.0, -1.0, 1.0])) @ bda
            if len(boxes):
                boxes[:, :3] = boxes[:, :3] @ bda.T
                boxes[:, 3:6] *= sc
                boxes[:, 6] = torch.atan2(bda[1, 0] * torch.cos(boxes[:, 6]) + bda[1, 1] * torch.sin(boxes[:, 6]),
                                          bda[0, 0] * torch.cos(boxes[:, 6]) + bda[0, 1] * torch.sin(boxes[:, 6]))
                boxes[:, 7:9] = boxes[:, 7:9] @ bda[:2, :2].T
        return dict(img=torch.stack(imgs), rots=torch.stack(rots), trans=torch.stack(trans),
                    intrins=torch.stack(intrins), ida=torch.stack(idas), bda=bda,
                    gt_boxes=boxes, gt_labels=labels, token=info["token"])


def collate(batch):
    out = {k: torch.stack([b[k] for b in batch]) for k in ("img", "rots", "trans", "intrins", "ida", "bda")}
    out["gt_boxes"] = [b["gt_boxes"] for b in batch]
    out["gt_labels"] = [b["gt_labels"] for b in batch]
    out["tokens"] = [b["token"] for b in batch]
    return out


class BEVDet(nn.Module):
    def __init__(self):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2, r50.layer3)
        self.layer4 = r50.layer4
        self.neck = nn.Sequential(nn.Conv2d(1024 + 2048, 512, 1, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
                                  nn.Conv2d(512, 512, 3, padding=1, bias=False), nn.BatchNorm2d(512), nn.ReLU(True))
        self.view_transformer = LSSViewTransformer(in_channels=512, out_channels=64, input_size=FINAL_DIM,
                                                   downsample=16, grid_config=dict(x=[-51.2, 51.2, 0.8],
                                                   y=[-51.2, 51.2, 0.8], z=[-5, 3, 8], depth=[1.0, 60.0, 1.0]))
        chans = [64, 128, 256, 512]
        enc = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            enc.append(nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True),
                                     nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)))
        self.bev_encoder = nn.ModuleList(enc)
        self.bev_fpn = nn.Sequential(nn.Conv2d(128 + 512, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.head = CenterHead(256, tasks=[[c] for c in CLASSES], out_size_factor=8, bbox_code_size=9)

    def forward(self, img, rots, trans, intrins, ida, bda):
        B, N = img.shape[:2]
        c3 = self.backbone(img.flatten(0, 1))
        c4 = self.layer4(c3)
        x = self.neck(torch.cat([c3, F.interpolate(c4, size=c3.shape[-2:], mode="bilinear")], 1))
        x = x.view(B, N, *x.shape[1:])
        bev = self.view_transformer(x, rots, trans, intrins, ida, bda)
        feats = []
        for layer in self.bev_encoder:
            bev = layer(bev)
            feats.append(bev)
        up = F.interpolate(feats[-1], size=feats[0].shape[-2:], mode="bilinear", align_corners=True)
        bev = self.bev_fpn(torch.cat([feats[0], up], 1))
        return self.head(bev)


def save_checkpoint(work_dir, model, optimizer, scheduler, epoch):
    state = {"meta": {"epoch": epoch, "time": time.asctime()}, "state_dict": model.module.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    path = os.path.join(work_dir, f"epoch_{epoch}.pth")
    torch.save(state, path)
    latest = os.path.join(work_dir, "latest.pth")
    if os.path.lexists(latest):
        os.remove(latest)
    os.symlink(os.path.basename(path), latest)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--samples-per-gpu", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)  # 8 x 8
    ap.add_argument("--eval-every", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    os.makedirs(args.work_dir, exist_ok=True)
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(message)s",
                            handlers=[logging.StreamHandler(), logging.FileHandler(os.path.join(args.work_dir, "log.txt"))])

    train_set = BEVDetDataset(args.data_root, "train", training=True)
    train_set = CBGSIndex(train_set, [[CLASSES.index(n) for n in info["gt_names"] if n in CLASSES]
                                      for info in train_set.infos], seed=0)
    val_set = BEVDetDataset(args.data_root, "val", training=False)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.samples_per_gpu, sampler=sampler, num_workers=6,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 4, sampler=DistributedSampler(val_set, shuffle=False), num_workers=4,
                            collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(BEVDet()).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[len(train_loader) * 20], gamma=0.1)

    start_epoch = 1
    ckpts = sorted(glob.glob(os.path.join(args.work_dir, "epoch_*.pth")), key=os.path.getmtime)
    if ckpts:
        ck = torch.load(ckpts[-1], map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["meta"]["epoch"] + 1
        logger.info("auto-resumed from %s", ckpts[-1])

    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        for i, b in enumerate(train_loader):
            inputs = [b[k].cuda(non_blocking=True) for k in ("img", "rots", "trans", "intrins", "ida", "bda")]
            preds = model(*inputs)
            losses = model.module.head.loss([x.cuda() for x in b["gt_boxes"]], [x.cuda() for x in b["gt_labels"]], preds)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 50 == 0:
                logger.info("Epoch [%d][%d/%d] lr: %.3e loss: %.4f", epoch, i, len(train_loader),
                            optimizer.param_groups[0]["lr"], loss.item())
        save_checkpoint(args.work_dir, model, optimizer, scheduler, epoch)

        if epoch % args.eval_every == 0:
            model.eval()
            results = {}
            with torch.no_grad():
                for b in val_loader:
                    inputs = [b[k].cuda(non_blocking=True) for k in ("img", "rots", "trans", "intrins", "ida", "bda")]
                    for tok, det in zip(b["tokens"], model.module.head.get_bboxes(model(*inputs))):
                        results[tok] = {k: v.cpu() for k, v in det.items()}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, results)
            if rank == 0:
                merged = {k: v for part in gathered for k, v in part.items()}
                metrics = nuscenes_evaluate(merged, CLASSES, args.data_root, os.path.join(args.work_dir, "eval"))
                logger.info("epoch %d mAP: %.4f NDS: %.4f", epoch, metrics["mAP"], metrics["NDS"])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
