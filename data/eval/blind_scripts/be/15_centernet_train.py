"""CenterNet (objects as points), DLA-34 backbone, COCO ctdet.

Single process, multiple GPUs through nn.DataParallel, as in the original repo:

    python 15_centernet_train.py --gpus 0,1,2,3 --batch_size 114 --master_batch 18 --lr 5e-4 --num_epochs 140
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader

from lib.datasets.coco_ctdet import COCOCtdet
from lib.models.model import create_model, load_model, save_model
from lib.models.losses import FocalLoss, RegL1Loss
from lib.models.decode import ctdet_decode
from lib.models.utils import _sigmoid
from lib.utils.post_process import ctdet_post_process
from lib.utils.data_parallel import DataParallel  # supports chunk_sizes (smaller batch on the master GPU)


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


class CtdetLoss(nn.Module):
    def __init__(self, opt):
        super().__init__()
        self.crit = FocalLoss()
        self.crit_reg = RegL1Loss()
        self.opt = opt

    def forward(self, output, batch):
        hm = _sigmoid(output["hm"])
        hm_loss = self.crit(hm, batch["hm"])
        wh_loss = self.crit_reg(output["wh"], batch["reg_mask"], batch["ind"], batch["wh"])
        off_loss = self.crit_reg(output["reg"], batch["reg_mask"], batch["ind"], batch["reg"])
        loss = self.opt.hm_weight * hm_loss + self.opt.wh_weight * wh_loss + self.opt.off_weight * off_loss
        return loss, {"loss": loss, "hm_loss": hm_loss, "wh_loss": wh_loss, "off_loss": off_loss}


class ModelWithLoss(nn.Module):
    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, batch):
        outputs = self.model(batch["input"])
        loss, loss_stats = self.loss(outputs[-1], batch)
        return outputs[-1], loss, loss_stats


def parse_opt():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="dla_34")
    p.add_argument("--data_dir", default="data/coco")
    p.add_argument("--gpus", default="0")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--master_batch", type=int, default=-1)
    p.add_argument("--lr", type=float, default=1.25e-4)
    p.add_argument("--lr_step", default="90,120")
    p.add_argument("--num_epochs", type=int, default=140)
    p.add_argument("--val_intervals", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--head_conv", type=int, default=256)
    p.add_argument("--hm_weight", type=float, default=1.0)
    p.add_argument("--wh_weight", type=float, default=0.1)
    p.add_argument("--off_weight", type=float, default=1.0)
    p.add_argument("--K", type=int, default=100)
    p.add_argument("--save_dir", default="exp/ctdet/coco_dla")
    p.add_argument("--load_model", default="")
    p.add_argument("--resume", action="store_true")
    opt = p.parse_args()
    opt.gpus = [int(g) for g in opt.gpus.split(",")]
    opt.lr_step = [int(s) for s in opt.lr_step.split(",")]
    if opt.master_batch == -1:
        opt.master_batch = opt.batch_size // len(opt.gpus)
    rest = opt.batch_size - opt.master_batch
    opt.chunk_sizes = [opt.master_batch]
    for i in range(len(opt.gpus) - 1):
        chunk = rest // (len(opt.gpus) - 1)
        if i < rest % (len(opt.gpus) - 1):
            chunk += 1
        opt.chunk_sizes.append(chunk)
    return opt


def run_epoch(model_with_loss, loader, optimizer, opt, epoch, train=True):
    model_with_loss.train(train)
    meters = {k: AverageMeter() for k in ("loss", "hm_loss", "wh_loss", "off_loss")}
    t0 = time.time()
    for it, batch in enumerate(loader):
        batch = {k: v.to(opt.device, non_blocking=True) for k, v in batch.items() if k != "meta"}
        with torch.set_grad_enabled(train):
            output, loss, loss_stats = model_with_loss(batch)
        if train:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for k in meters:
            meters[k].update(loss_stats[k].mean().item(), batch["input"].size(0))
        if it % 100 == 0:
            print(f"{'train' if train else 'val'} [{epoch}][{it}/{len(loader)}] "
                  + " | ".join(f"{k} {m.avg:.4f}" for k, m in meters.items())
                  + f" | {time.time() - t0:.0f}s", flush=True)
    return {k: m.avg for k, m in meters.items()}


@torch.no_grad()
def coco_eval(model, dataset, opt):
    model.eval()
    loader = DataLoader(dataset, batch_size=1, shuffle=False, num_workers=4)
    detections = []
    for batch in loader:
        meta = batch["meta"]
        out = model(batch["input"].to(opt.device))[-1]
        dets = ctdet_decode(out["hm"].sigmoid_(), out["wh"], reg=out["reg"], K=opt.K)
        dets = dets.cpu().numpy().reshape(1, -1, dets.shape[2])
        dets = ctdet_post_process(dets.copy(), [meta["c"].numpy()], [meta["s"].numpy()],
                                  meta["out_height"].item(), meta["out_width"].item(), dataset.num_classes)[0]
        img_id = int(meta["img_id"])
        for cls_ind, boxes in dets.items():
            for b in boxes:
                detections.append({"image_id": img_id, "category_id": dataset._valid_ids[cls_ind - 1],
                                   "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])],
                                   "score": float(b[4])})
    if not detections:
        return 0.0
    ev = COCOeval(dataset.coco, dataset.coco.loadRes(detections), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    opt = parse_opt()
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in opt.gpus)
    opt.gpus = list(range(len(opt.gpus)))
    opt.device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    os.makedirs(opt.save_dir, exist_ok=True)

    heads = {"hm": 80, "wh": 2, "reg": 2}
    model = create_model(opt.arch, heads, opt.head_conv)
    optimizer = torch.optim.Adam(model.parameters(), opt.lr)
    start_epoch = 0
    if opt.load_model:
        model, optimizer, start_epoch = load_model(model, opt.load_model, optimizer, opt.resume, opt.lr, opt.lr_step)

    model_with_loss = ModelWithLoss(model, CtdetLoss(opt))
    if len(opt.gpus) > 1:
        model_with_loss = DataParallel(model_with_loss, device_ids=opt.gpus, chunk_sizes=opt.chunk_sizes).to(opt.device)
    else:
        model_with_loss = model_with_loss.to(opt.device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(opt.device, non_blocking=True)

    train_set = COCOCtdet(opt, "train")
    val_set = COCOCtdet(opt, "val")
    train_loader = DataLoader(train_set, batch_size=opt.batch_size, shuffle=True, num_workers=opt.num_workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, shuffle=False, num_workers=1, pin_memory=True)

    best_ap = 0.0
    for epoch in range(start_epoch + 1, opt.num_epochs + 1):
        log = run_epoch(model_with_loss, train_loader, optimizer, opt, epoch, train=True)
        save_model(os.path.join(opt.save_dir, "model_last.pth"), epoch, model, optimizer)
        if opt.val_intervals > 0 and epoch % opt.val_intervals == 0:
            val_log = run_epoch(model_with_loss, val_loader, None, opt, epoch, train=False)
            ap = coco_eval(model, val_set, opt)
            print(f"epoch {epoch}: train loss {log['loss']:.4f} val loss {val_log['loss']:.4f} AP {ap:.4f}")
            with open(os.path.join(opt.save_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **log, "val_loss": val_log["loss"], "AP": ap}) + "\n")
            if ap > best_ap:
                best_ap = ap
                save_model(os.path.join(opt.save_dir, "model_best.pth"), epoch, model)
        if epoch in opt.lr_step:
            save_model(os.path.join(opt.save_dir, f"model_{epoch}.pth"), epoch, model, optimizer)
            lr = opt.lr * (0.1 ** (opt.lr_step.index(epoch) + 1))
            for g in optimizer.param_groups:
                g["lr"] = lr
            print("Drop LR to", lr)


if __name__ == "__main__":
    main()
