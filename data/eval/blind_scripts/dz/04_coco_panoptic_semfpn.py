"""Semantic FPN (R-50) on COCO-panoptic semantic labels (133 classes).

Used as the semantic-branch pretraining for our panoptic models. The semantic
PNGs are derived from panoptic_{train,val}2017.json on first use.

    torchrun --nproc_per_node=8 04_coco_panoptic_semfpn.py --data-root /datasets/coco
"""
import argparse
import json
import os
import random
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet50_Weights
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from tqdm import tqdm

IGNORE = 255
PIXEL_MEAN = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
PIXEL_STD = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/datasets/coco")
    ap.add_argument("--out", default="work_dirs/semfpn_r50_cocopan")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--ims-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--max-iter", type=int, default=90000)
    ap.add_argument("--eval-period", type=int, default=10000)
    ap.add_argument("--num-workers", type=int, default=4)
    return ap.parse_args()


def convert_panoptic_to_semseg(pan_json, pan_dir, out_dir):
    with open(pan_json) as f:
        data = json.load(f)
    id_map = {cat["id"]: i for i, cat in enumerate(sorted(data["categories"], key=lambda c: c["id"]))}
    os.makedirs(out_dir, exist_ok=True)
    for ann in tqdm(data["annotations"], desc=os.path.basename(out_dir)):
        pan = np.asarray(Image.open(os.path.join(pan_dir, ann["file_name"])), dtype=np.uint32)
        pan = pan[..., 0] + 256 * pan[..., 1] + 256 * 256 * pan[..., 2]
        sem = np.full(pan.shape, IGNORE, dtype=np.uint8)
        for seg in ann["segments_info"]:
            sem[pan == seg["id"]] = id_map[seg["category_id"]]
        Image.fromarray(sem).save(os.path.join(out_dir, ann["file_name"]))
    return len(id_map)


class COCOPanopticSem(Dataset):
    def __init__(self, root, split, crop, train):
        with open(os.path.join(root, "annotations", f"panoptic_{split}2017.json")) as f:
            anns = json.load(f)["annotations"]
        self.items = [(os.path.join(root, f"{split}2017", a["file_name"].replace(".png", ".jpg")),
                       os.path.join(root, f"panoptic_semseg_{split}2017", a["file_name"])) for a in anns]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img_p, sem_p = self.items[i]
        img = Image.open(img_p).convert("RGB")
        sem = Image.open(sem_p)
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            base = 640 / max(w, h)
            size = (max(int(w * base * s), 1), max(int(h * base * s), 1))
            img, sem = img.resize(size, Image.BILINEAR), sem.resize(size, Image.NEAREST)
            img, sem = np.asarray(img), np.asarray(sem)
            ph, pw = max(self.crop - sem.shape[0], 0), max(self.crop - sem.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            sem = np.pad(sem, ((0, ph), (0, pw)), constant_values=IGNORE)
            y = random.randint(0, sem.shape[0] - self.crop)
            x = random.randint(0, sem.shape[1] - self.crop)
            img, sem = img[y:y + self.crop, x:x + self.crop], sem[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, sem = img[:, ::-1], sem[:, ::-1]
        else:
            w, h = img.size
            r = 640 / max(w, h)
            img = np.asarray(img.resize((int(w * r), int(h * r)), Image.BILINEAR))
            sem = np.asarray(sem)
        img = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float()
        img = (img - PIXEL_MEAN) / PIXEL_STD
        return img, torch.from_numpy(np.ascontiguousarray(sem)).long()


class SemanticFPN(nn.Module):
    def __init__(self, num_classes, conv_dims=128):
        super().__init__()
        self.backbone = resnet_fpn_backbone(backbone_name="resnet50", weights=ResNet50_Weights.IMAGENET1K_V1,
                                            trainable_layers=5, returned_layers=[1, 2, 3, 4])
        self.heads = nn.ModuleList()
        for lvl in range(4):
            layers = []
            for k in range(max(1, lvl)):
                layers += [nn.Conv2d(256 if k == 0 else conv_dims, conv_dims, 3, padding=1, bias=False),
                           nn.GroupNorm(32, conv_dims), nn.ReLU(inplace=True)]
                if lvl > 0:
                    layers.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
            self.heads.append(nn.Sequential(*layers))
        self.predictor = nn.Conv2d(conv_dims, num_classes, 1)

    def forward(self, x):
        feats = list(self.backbone(x).values())[:4]
        y = sum(h(f) for h, f in zip(self.heads, feats))
        y = self.predictor(y)
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    conf = torch.zeros(n * n, dtype=torch.int64, device=device)
    for img, sem in loader:
        img, sem = img.to(device), sem.to(device)
        logit = model(img)
        logit = F.interpolate(logit, size=sem.shape[-2:], mode="bilinear", align_corners=False)
        pred = logit.argmax(1)
        k = sem != IGNORE
        conf += torch.bincount(sem[k] * n + pred[k], minlength=n * n)
    dist.all_reduce(conf)
    conf = conf.view(n, n).double()
    iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag())
    model.train()
    return torch.nanmean(iou).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    num_classes = 133
    for split in ("train", "val"):
        sem_dir = os.path.join(args.data_root, f"panoptic_semseg_{split}2017")
        if not os.path.isdir(sem_dir):
            num_classes = convert_panoptic_to_semseg(
                os.path.join(args.data_root, "annotations", f"panoptic_{split}2017.json"),
                os.path.join(args.data_root, "annotations", f"panoptic_{split}2017"),
                sem_dir)

    train_ds = COCOPanopticSem(args.data_root, "train", args.crop, train=True)
    val_ds = COCOPanopticSem(args.data_root, "val", args.crop, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.ims_per_gpu, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1, num_workers=2)

    net = SemanticFPN(num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / 1000) * (1 - i / args.max_iter) ** 0.9)

    it, epoch, best = 0, 0, 0.0
    tic = time.time()
    while it < args.max_iter:
        train_sampler.set_epoch(epoch)
        for img, sem in train_loader:
            img = img.to(device, non_blocking=True)
            sem = sem.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), sem, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 20 == 0 and rank == 0:
                print(f"iter {it} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.5f} "
                      f"time {(time.time() - tic) / 20:.3f}", flush=True)
                tic = time.time()
            if it % args.eval_period == 0 or it == args.max_iter:
                miou = evaluate(net, val_loader, num_classes, device)
                if rank == 0:
                    print(f"[eval] iter {it} mIoU {miou * 100:.2f}", flush=True)
                    state = OrderedDict(model=net.state_dict(), optimizer=optimizer.state_dict(),
                                        scheduler=scheduler.state_dict(), iteration=it)
                    torch.save(state, os.path.join(args.out, f"model_{it:07d}.pth"))
                    if miou > best:
                        best = miou
                        torch.save(state, os.path.join(args.out, "model_best.pth"))
                dist.barrier()
            if it >= args.max_iter:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
