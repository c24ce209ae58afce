"""Minimal YOLOv5 DDP trainer (own loop, reuses the repo's model / dataloader / val).

    torchrun --nproc_per_node=4 16_yolov5_train_ddp.py --data data/visdrone.yaml --cfg models/yolov5m.yaml \
        --weights yolov5m.pt --batch-size 16 --multi-scale
"""
import argparse
import math
import os
import random
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from models.yolo import Model
from utils.dataloaders import create_dataloader
from utils.general import check_img_size, labels_to_class_weights
from utils.metrics import bbox_iou, fitness
from utils.torch_utils import ModelEMA, torch_distributed_zero_first
import val as validate


class ComputeLoss:
    """YOLOv5 loss: CIoU box, BCE objectness (per-level balance), BCE classes."""

    def __init__(self, model, autobalance=False):
        device = next(model.parameters()).device
        h = model.hyp
        self.BCEcls = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["cls_pw"]], device=device))
        self.BCEobj = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([h["obj_pw"]], device=device))
        m = model.model[-1]  # Detect() module
        self.balance = {3: [4.0, 1.0, 0.4]}.get(m.nl, [4.0, 1.0, 0.25, 0.06, 0.02])
        self.hyp, self.gr = h, 1.0
        self.na, self.nc, self.nl, self.anchors = m.na, m.nc, m.nl, m.anchors

    def __call__(self, p, targets):
        device = targets.device
        lcls, lbox, lobj = (torch.zeros(1, device=device) for _ in range(3))
        tcls, tbox, indices, anch = self.build_targets(p, targets)
        for i, pi in enumerate(p):
            b, a, gj, gi = indices[i]
            tobj = torch.zeros(pi.shape[:4], dtype=pi.dtype, device=device)
            n = b.shape[0]
            if n:
                pxy, pwh, _, pcls = pi[b, a, gj, gi].split((2, 2, 1, self.nc), 1)
                pxy = pxy.sigmoid() * 2 - 0.5
                pwh = (pwh.sigmoid() * 2) ** 2 * anch[i]
                iou = bbox_iou(torch.cat((pxy, pwh), 1), tbox[i], CIoU=True).squeeze()
                lbox += (1.0 - iou).mean()
                tobj[b, a, gj, gi] = iou.detach().clamp(0).type(tobj.dtype)
                if self.nc > 1:
                    t = torch.zeros_like(pcls)
                    t[range(n), tcls[i]] = 1.0
                    lcls += self.BCEcls(pcls, t)
            lobj += self.BCEobj(pi[..., 4], tobj) * self.balance[i]
        lbox *= self.hyp["box"]
        lobj *= self.hyp["obj"]
        lcls *= self.hyp["cls"]
        bs = p[0].shape[0]
        return (lbox + lobj + lcls) * bs, torch.cat((lbox, lobj, lcls)).detach()

    def build_targets(self, p, targets):
        na, nt = self.na, targets.shape[0]
        tcls, tbox, indices, anch = [], [], [], []
        gain = torch.ones(7, device=targets.device)
        ai = torch.arange(na, device=targets.device).float().view(na, 1).repeat(1, nt)
        targets = torch.cat((targets.repeat(na, 1, 1), ai[..., None]), 2)
        g = 0.5
        off = torch.tensor([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1]], device=targets.device).float() * g
        for i in range(self.nl):
            anchors, shape = self.anchors[i], p[i].shape
            gain[2:6] = torch.tensor(shape)[[3, 2, 3, 2]]
            t = targets * gain
            if nt:
                r = t[..., 4:6] / anchors[:, None]
                j = torch.max(r, 1 / r).max(2)[0] < self.hyp["anchor_t"]
                t = t[j]
                gxy = t[:, 2:4]
                gxi = gain[[2, 3]] - gxy
                j, k = ((gxy % 1 < g) & (gxy > 1)).T
                l, m = ((gxi % 1 < g) & (gxi > 1)).T
                j = torch.stack((torch.ones_like(j), j, k, l, m))
                t = t.repeat((5, 1, 1))[j]
                offsets = (torch.zeros_like(gxy)[None] + off[:, None])[j]
            else:
                t, offsets = targets[0], 0
            bc, gxy, gwh, a = t.chunk(4, 1)
            a, (b, c) = a.long().view(-1), bc.long().T
            gij = (gxy - offsets).long()
            gi, gj = gij.T
            indices.append((b, a, gj.clamp_(0, shape[2] - 1), gi.clamp_(0, shape[3] - 1)))
            tbox.append(torch.cat((gxy - gij, gwh), 1))
            anch.append(anchors[a])
            tcls.append(c)
        return tcls, tbox, indices, anch


def parse_opt():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default="yolov5m.pt")
    p.add_argument("--cfg", default="models/yolov5m.yaml")
    p.add_argument("--data", default="data/visdrone.yaml")
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-med.yaml")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--multi-scale", action="store_true")
    p.add_argument("--project", default="runs/ddp")
    return p.parse_args()


def main():
    opt = parse_opt()
    local_rank, rank = int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    with open(opt.hyp) as f:
        hyp = yaml.safe_load(f)
    with open(opt.data) as f:
        data = yaml.safe_load(f)
    nc, names = int(data["nc"]), data["names"]
    save_dir = Path(opt.project)
    (save_dir / "weights").mkdir(parents=True, exist_ok=True)

    with torch_distributed_zero_first(local_rank):
        ckpt = torch.load(opt.weights, map_location="cpu")  # may trigger a download on local rank 0
    model = Model(opt.cfg, ch=3, nc=nc).to(device)
    csd = ckpt["model"].float().state_dict()
    csd = {k: v for k, v in csd.items() if k in model.state_dict() and model.state_dict()[k].shape == v.shape
           and "anchor" not in k}
    model.load_state_dict(csd, strict=False)
    gs = max(int(model.stride.max()), 32)
    imgsz = check_img_size(opt.imgsz, gs, floor=gs * 2)

    with torch_distributed_zero_first(local_rank):  # rank 0 writes the labels cache first
        train_loader, dataset = create_dataloader(data["train"], imgsz, opt.batch_size, gs, hyp=hyp, augment=True,
                                                  rank=local_rank, workers=8, shuffle=True)
    val_loader = create_dataloader(data["val"], imgsz, opt.batch_size * 2, gs, hyp=hyp, rect=True, rank=-1,
                                   workers=8, pad=0.5)[0] if rank == 0 else None

    nl = model.model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (imgsz / 640) ** 2 * 3 / nl
    model.nc, model.hyp, model.names = nc, hyp, names
    model.class_weights = labels_to_class_weights(dataset.labels, nc).to(device) * nc

    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ema = ModelEMA(model) if rank == 0 else None
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    compute_loss = ComputeLoss(model)

    g_bn = [v.weight for v in model.modules() if isinstance(v, nn.modules.batchnorm._BatchNorm)]
    g_b = [v.bias for v in model.modules() if hasattr(v, "bias") and isinstance(v.bias, nn.Parameter)]
    g_w = [v.weight for v in model.modules()
           if hasattr(v, "weight") and isinstance(v.weight, nn.Parameter)
           and not isinstance(v, nn.modules.batchnorm._BatchNorm)]
    optimizer = torch.optim.SGD(g_bn, lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True)
    optimizer.add_param_group({"params": g_w, "weight_decay": hyp["weight_decay"]})
    optimizer.add_param_group({"params": g_b})
    lf = lambda x: (1 - x / opt.epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    scaler = torch.cuda.amp.GradScaler()

    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    best_fitness = 0.0
    for epoch in range(opt.epochs):
        model.train()
        train_loader.sampler.set_epoch(epoch)
        for i, (imgs, targets, paths, _) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255
            if ni <= nw:
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, [0, nw], [hyp["warmup_bias_lr"] if j == 2 else 0.0,
                                                      x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, [0, nw], [hyp["warmup_momentum"], hyp["momentum"]])
            if opt.multi_scale:
                sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5) + gs) // gs * gs
                sf = sz / max(imgs.shape[2:])
                if sf != 1:
                    ns = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
                    imgs = F.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)

            with torch.cuda.amp.autocast():
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
                loss *= world_size  # DDP averages gradients over ranks
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            if ema:
                ema.update(model)
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}/{opt.epochs}][{i}/{nb}] box {loss_items[0]:.4f} obj {loss_items[1]:.4f} "
                      f"cls {loss_items[2]:.4f} imgsz {imgs.shape[-1]}", flush=True)
        scheduler.step()

        if rank == 0:
            results, maps, _ = validate.run(data, batch_size=opt.batch_size * 2, imgsz=imgsz, half=True,
                                            model=ema.ema, dataloader=val_loader, save_dir=save_dir, plots=False)
            fi = fitness(np.array(results).reshape(1, -1))[0]
            state = {"epoch": epoch, "best_fitness": max(best_fitness, fi), "model": None,
                     "ema": deepcopy(ema.ema).half(), "updates": ema.updates, "optimizer": optimizer.state_dict()}
            torch.save(state, save_dir / "weights" / "last.pt")
            if fi > best_fitness:
                best_fitness = fi
                torch.save(state, save_dir / "weights" / "best.pt")
            print(f"epoch {epoch}: mAP50 {results[2]:.4f} mAP50-95 {results[3]:.4f} fitness {fi:.4f}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
