"""FlashOcc-style 3D occupancy (Occ3D-nuScenes, 200x200x16, 18 classes) from 6 cameras.

BEV features from LSS, then a channel-to-height head predicts the 16 height bins.
Metric: mIoU over the 17 semantic classes (free excluded), camera-visible voxels only.

    torchrun --nproc_per_node=8 train_flashocc.py --data-root data/nuscenes --occ-root data/gts \
        --work-dir work_dirs/flashocc_r50
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

from av3d.models.view_transform import LSSViewTransformer

OCC_CLASSES = ["others", "barrier", "bicycle", "bus", "car", "construction_vehicle", "motorcycle", "pedestrian",
               "traffic_cone", "trailer", "truck", "driveable_surface", "other_flat", "sidewalk", "terrain",
               "manmade", "vegetation", "free"]
NUM_CLS = len(OCC_CLASSES)
FREE = 17
CAMS = ["CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"]
log = logging.getLogger("flashocc")


class Occ3DNuScenes(Dataset):
    def __init__(self, data_root, occ_root, split, training):
        with open(os.path.join(data_root, f"bevdetv2-nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.data_root, self.occ_root, self.training = data_root, occ_root, training
        self.tf = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, rots, trans, intrins, post = [], [], [], [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.data_root, c["data_path"])).convert("RGB")
            s = 704 / img.width
            nh = int(img.height * s)
            img = img.resize((704, nh)).crop((0, nh - 256, 704, nh))
            P = torch.eye(3)
            P[0, 0] = P[1, 1] = s
            P[1, 2] = -(nh - 256)
            if self.training and np.random.rand() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                P = torch.tensor([[-1.0, 0, 703.0], [0, 1, 0], [0, 0, 1]]) @ P
            imgs.append(self.tf(img))
            rots.append(torch.tensor(c["sensor2ego_rotation_matrix"], dtype=torch.float32))
            trans.append(torch.tensor(c["sensor2ego_translation"], dtype=torch.float32))
            intrins.append(torch.tensor(c["cam_intrinsic"], dtype=torch.float32))
            post.append(P)
        occ = np.load(os.path.join(self.occ_root, info["scene_name"], info["token"], "labels.npz"))
        return {
            "imgs": torch.stack(imgs), "rots": torch.stack(rots), "trans": torch.stack(trans),
            "intrins": torch.stack(intrins), "post": torch.stack(post),
            "semantics": torch.from_numpy(occ["semantics"].astype(np.int64)),      # 200, 200, 16
            "mask_camera": torch.from_numpy(occ["mask_camera"].astype(np.bool_)),  # 200, 200, 16
        }


class FlashOcc(nn.Module):
    def __init__(self, bev_ch=64, Dz=16):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.img_backbone = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2, r50.layer3)
        self.img_neck = nn.Sequential(nn.Conv2d(1024, 256, 1), nn.GroupNorm(32, 256), nn.ReLU(True))
        self.vt = LSSViewTransformer(in_channels=256, out_channels=bev_ch, input_size=(256, 704), downsample=16,
                                     grid_config=dict(x=[-40, 40, 0.4], y=[-40, 40, 0.4], z=[-1, 5.4, 6.4],
                                                      depth=[1.0, 45.0, 0.5]))
        self.bev_encoder = nn.Sequential(
            nn.Conv2d(bev_ch, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
            nn.Conv2d(128, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
            nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.Dz = Dz
        self.c2h = nn.Sequential(nn.Conv2d(256, 256, 3, padding=1), nn.Softplus(),
                                 nn.Conv2d(256, NUM_CLS * Dz, 1))

    def forward(self, imgs, rots, trans, intrins, post):
        B, N = imgs.shape[:2]
        f = self.img_neck(self.img_backbone(imgs.flatten(0, 1)))
        bev = self.vt(f.view(B, N, *f.shape[1:]), rots, trans, intrins, post)  # B, C, 200, 200
        x = self.c2h(self.bev_encoder(bev))
        return x.view(B, NUM_CLS, self.Dz, *x.shape[-2:]).permute(0, 1, 4, 3, 2)  # B, cls, X, Y, Z


def occ_loss(logits, sem, mask, class_weight):
    ce = F.cross_entropy(logits, sem, weight=class_weight, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def fast_hist(pred, gt, n):
    k = (gt >= 0) & (gt < n)
    return np.bincount(n * gt[k].astype(int) + pred[k], minlength=n ** 2).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    hist = np.zeros((NUM_CLS, NUM_CLS), dtype=np.int64)
    for b in loader:
        logits = model(*(b[k].cuda(non_blocking=True) for k in ("imgs", "rots", "trans", "intrins", "post")))
        pred = logits.argmax(1).cpu().numpy()
        sem, mask = b["semantics"].numpy(), b["mask_camera"].numpy()
        hist += fast_hist(pred[mask], sem[mask], NUM_CLS)
    hist = torch.from_numpy(hist)
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.numpy().astype(np.float64)
    iou = np.diag(hist) / np.maximum(hist.sum(0) + hist.sum(1) - np.diag(hist), 1)
    model.train()
    return iou[:FREE]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--occ-root", default="data/gts")
    ap.add_argument("--work-dir", default="work_dirs/flashocc")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--samples-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = Occ3DNuScenes(args.data_root, args.occ_root, "train", training=True)
    val_ds = Occ3DNuScenes(args.data_root, args.occ_root, "val", training=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.samples_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.samples_per_gpu, num_workers=8,
                        pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(FlashOcc()).cuda()
    model = DDP(model, device_ids=[local_rank])
    # class-balanced weights from Occ3D train-set voxel frequencies (precomputed)
    freq = torch.tensor([944004, 1897170, 152386, 2391677, 16957802, 724139, 189027, 2074468, 413451, 2384460,
                         5916653, 175883646, 4275424, 51393615, 61411620, 105975596, 116424404, 1892500630],
                        dtype=torch.float64)
    class_weight = (1.0 / torch.log(freq + 1.02 * freq.sum() / freq.max())).float().cuda()
    class_weight = class_weight / class_weight.mean()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.samples_per_gpu / 32, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[len(train_dl) * 20], gamma=0.1)
    warmup = 200

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for b in train_dl:
            if step < warmup:
                for g in opt.param_groups:
                    g["lr"] = g["initial_lr"] * (0.001 + 0.999 * step / warmup)
            logits = model(*(b[k].cuda(non_blocking=True) for k in ("imgs", "rots", "trans", "intrins", "post")))
            loss = occ_loss(logits, b["semantics"].cuda(non_blocking=True),
                            b["mask_camera"].cuda(non_blocking=True).float(), class_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                log.info("ep %d step %d loss %.4f lr %.2e %.2fs/it", epoch, step, loss.item(),
                         opt.param_groups[0]["lr"], (time.time() - t0) / 50)
                t0 = time.time()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        if (epoch + 1) % 4 == 0 or epoch + 1 == args.epochs:
            iou = evaluate(model, val_dl)
            if rank == 0:
                log.info("epoch %d mIoU %.2f | %s", epoch + 1, 100 * iou.mean(),
                         " ".join(f"{n}:{100 * v:.1f}" for n, v in zip(OCC_CLASSES, iou)))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
