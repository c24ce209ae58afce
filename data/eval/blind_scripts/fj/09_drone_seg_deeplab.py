#!/usr/bin/env python
"""Drone orthophoto segmentation (roof / road / vegetation / water / ...), DeepLabV3-R50.

An auxiliary FCN head on layer3 is trained for the first --aux-epochs epochs
only (deep supervision helps the early epochs, then it is dropped).

    torchrun --standalone --nproc_per_node=8 09_drone_seg_deeplab.py --root /data/drone_seg --epochs 80
"""
import argparse
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models import ResNet50_Weights, resnet50
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import DeepLabHead
from torchvision.models.segmentation.fcn import FCNHead
import torchvision.transforms.functional as TF

log = logging.getLogger("droneseg")
IGNORE = 255


# ------------------------------------------------------------------ data
class SegDataset(Dataset):
    MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

    def __init__(self, root, split, crop=512, train=True):
        names = (Path(root) / f"{split}.txt").read_text().split()
        self.items = [(Path(root) / "images" / f"{n}.jpg", Path(root) / "masks" / f"{n}.png") for n in names]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(self.items[i][0]).convert("RGB")
        mask = Image.open(self.items[i][1])
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            img = TF.resize(img, [int(h * s), int(w * s)], interpolation=TF.InterpolationMode.BILINEAR)
            mask = TF.resize(mask, [int(h * s), int(w * s)], interpolation=TF.InterpolationMode.NEAREST)
            pw, ph = max(0, self.crop - img.size[0]), max(0, self.crop - img.size[1])
            img = TF.pad(img, [0, 0, pw, ph], fill=0)
            mask = TF.pad(mask, [0, 0, pw, ph], fill=IGNORE)
            top = random.randint(0, img.size[1] - self.crop)
            left = random.randint(0, img.size[0] - self.crop)
            img, mask = TF.crop(img, top, left, self.crop, self.crop), TF.crop(mask, top, left, self.crop, self.crop)
            if random.random() < 0.5:
                img, mask = TF.hflip(img), TF.hflip(mask)
            if random.random() < 0.5:
                img, mask = TF.vflip(img), TF.vflip(mask)
        x = TF.normalize(TF.to_tensor(img), self.MEAN, self.STD)
        return x, torch.from_numpy(np.array(mask, dtype=np.int64))


# ------------------------------------------------------------------ model
class DeepLabWithAux(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        backbone = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, replace_stride_with_dilation=[False, True, True])
        self.backbone = IntermediateLayerGetter(backbone, return_layers={"layer3": "aux", "layer4": "out"})
        self.head = DeepLabHead(2048, num_classes)
        self.aux_head = FCNHead(1024, num_classes)

    def forward(self, x, with_aux=False):
        size = x.shape[-2:]
        feats = self.backbone(x)
        out = F.interpolate(self.head(feats["out"]), size=size, mode="bilinear", align_corners=False)
        if not with_aux:
            return out, None
        aux = F.interpolate(self.aux_head(feats["aux"]), size=size, mode="bilinear", align_corners=False)
        return out, aux


# ------------------------------------------------------------------ callbacks
class Callback:
    def on_epoch_end(self, trainer, logs): pass


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_miou"):
        self.out_dir, self.monitor, self.best = Path(out_dir), monitor, 0.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {"model": trainer.model.module.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                 "epoch": trainer.epoch, "logs": logs}
        torch.save(state, self.out_dir / "last.pt")
        if logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            torch.save(state, self.out_dir / "best.pt")


class EarlyStopping(Callback):
    def __init__(self, monitor="val_miou", patience=15):
        self.monitor, self.patience, self.best, self.bad = monitor, patience, 0.0, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] > self.best + 1e-4:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
        trainer.should_stop = self.bad >= self.patience


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0:
            log.info("epoch %d lr %.2e aux %s | %s", trainer.epoch, trainer.optimizer.param_groups[0]["lr"],
                     trainer.use_aux, " ".join(f"{k}={v:.4f}" for k, v in logs.items()))


# ------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, local_rank, num_classes, callbacks, aux_epochs=20, aux_weight=0.4):
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", local_rank)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        # the aux head is skipped after aux_epochs, so its parameters get no grad from then on
        self.model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, callbacks
        self.num_classes, self.aux_epochs, self.aux_weight = num_classes, aux_epochs, aux_weight
        self.epoch, self.should_stop, self.use_aux = 0, False, True

    def train_epoch(self, loader):
        self.model.train()
        self.use_aux = self.epoch < self.aux_epochs
        tot = torch.zeros(2, device=self.device)
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out, aux = self.model(x, with_aux=self.use_aux)
            loss = F.cross_entropy(out.float(), y, ignore_index=IGNORE)
            if aux is not None:
                loss = loss + self.aux_weight * F.cross_entropy(aux.float(), y, ignore_index=IGNORE)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
            self.optimizer.step()
            self.scheduler.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(tot)
        return {"train_loss": (tot[0] / tot[1]).item()}

    @torch.no_grad()
    def evaluate(self, loader):
        net = self.model.module
        net.eval()
        k = self.num_classes
        conf = torch.zeros(k * k, dtype=torch.int64, device=self.device)
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = net(x)[0].argmax(1)
            valid = y != IGNORE
            conf += torch.bincount(y[valid] * k + pred[valid], minlength=k * k)
        dist.all_reduce(conf)
        conf = conf.view(k, k).double()
        iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1)
        return {"val_miou": iou.mean().item(), "val_pixel_acc": (conf.diag().sum() / conf.sum()).item()}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.epoch = epoch
            train_loader.sampler.set_epoch(epoch)
            logs = self.train_epoch(train_loader)
            logs.update(self.evaluate(val_loader))
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.should_stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--num-classes", type=int, default=8)
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU; BN is synchronised across GPUs")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--aux-epochs", type=int, default=20)
    ap.add_argument("--out", default="runs/drone_deeplab")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    train_set = SegDataset(args.root, "train", args.crop, train=True)
    val_set = SegDataset(args.root, "val", train=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, drop_last=True),
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=1, num_workers=4, pin_memory=True)

    model = DeepLabWithAux(args.num_classes)
    params = [{"params": model.backbone.parameters(), "lr": args.lr},
              {"params": list(model.head.parameters()) + list(model.aux_head.parameters()), "lr": args.lr * 10}]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (1 - s / total) ** 0.9)
    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping()]
    trainer = Trainer(model, optimizer, scheduler, local_rank, args.num_classes, callbacks, aux_epochs=args.aux_epochs)
    trainer.fit(train_loader, val_loader, args.epochs)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
