"""Mask R-CNN with a Swin-T backbone (ImageNet-1k weights from torchvision), 3x schedule,
large-scale jitter, AdamW, AMP and activation checkpointing in the backbone (1024x1024 crops are heavy).

    torchrun --nproc_per_node=8 14_swin_mask_rcnn.py --data /data/coco --imgs-per-gpu 2 --grad-ckpt
"""
import argparse
import math
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models import swin_t, Swin_T_Weights
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from coco_data import CocoInstanceDataset, LargeScaleJitter, instance_collate
from coco_eval import CocoEvaluator


class SwinFPN(nn.Module):
    """Swin-T stages 1-4 -> FPN. Swin emits NHWC, the FPN wants NCHW."""

    def __init__(self, use_checkpoint=False, out_channels=256):
        super().__init__()
        self.body = swin_t(weights=Swin_T_Weights.IMAGENET1K_V1)
        self.use_checkpoint = use_checkpoint
        self.stage_ids = [1, 3, 5, 7]  # features[0] is patch embed, odd indices are the stages
        self.out_norms = nn.ModuleList([nn.LayerNorm(c) for c in (96, 192, 384, 768)])
        self.fpn = FeaturePyramidNetwork([96, 192, 384, 768], out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels

    def forward(self, x):
        outs = OrderedDict()
        k = 0
        for i, layer in enumerate(self.body.features):
            if self.use_checkpoint and self.training and i in self.stage_ids:
                x = cp.checkpoint(layer, x)
            else:
                x = layer(x)
            if i in self.stage_ids:
                outs[str(k)] = self.out_norms[k](x).permute(0, 3, 1, 2).contiguous()
                k += 1
        return self.fpn(outs)


def build_model(num_classes, use_checkpoint):
    backbone = SwinFPN(use_checkpoint=use_checkpoint)
    anchor_gen = AnchorGenerator(sizes=((32,), (64,), (128,), (256,), (512,)),
                                 aspect_ratios=((0.5, 1.0, 2.0),) * 5)
    return MaskRCNN(backbone, num_classes=num_classes, rpn_anchor_generator=anchor_gen,
                    min_size=1024, max_size=1024, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or "relative_position_bias_table" in n or "norm" in n:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/coco")
    ap.add_argument("--imgs-per-gpu", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=36)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-iters", type=int, default=1000)
    ap.add_argument("--milestones", type=int, nargs="+", default=[27, 33])
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--workdir", default="work_dirs/swin_t_mrcnn_3x")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    evaluator = CocoEvaluator(loader.dataset.coco, ["bbox", "segm"])
    for images, targets in loader:
        images = [im.to(device, non_blocking=True) for im in images]
        with torch.cuda.amp.autocast():
            outputs = model(images)
        outputs = [{k: v.float().cpu() for k, v in o.items()} for o in outputs]
        evaluator.update({t["image_id"]: o for t, o in zip(targets, outputs)})
    evaluator.synchronize_between_processes()  # all_gather_object on every rank, dedups padded images
    evaluator.accumulate()
    evaluator.summarize()
    model.train()
    return evaluator.coco_eval["bbox"].stats[0], evaluator.coco_eval["segm"].stats[0]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)

    train_set = CocoInstanceDataset(args.data, "train2017", transforms=LargeScaleJitter(1024, (0.1, 2.0)))
    val_set = CocoInstanceDataset(args.data, "val2017", transforms=None)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.imgs_per_gpu, sampler=train_sampler, num_workers=6,
                              collate_fn=instance_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=2, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, collate_fn=instance_collate, pin_memory=True)

    model = build_model(91, args.grad_ckpt).to(device)
    optimizer = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.999))
    iters_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, [m * iters_per_epoch for m in args.milestones], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_segm = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_segm = ckpt["epoch"] + 1, ckpt["best_segm"]

    # the classification head and final norm of the torchvision Swin are never used
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    step = start_epoch * iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
            if step < args.warmup_iters:
                for g in optimizer.param_groups:
                    g["lr"] = args.lr * (0.001 + 0.999 * step / args.warmup_iters)

            with torch.cuda.amp.autocast():
                loss_dict = model(images, targets)
                loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if it % 50 == 0:
                vals = torch.stack([v.detach().float() for v in loss_dict.values()])
                dist.all_reduce(vals)
                vals /= world
                if rank == 0:
                    msg = " ".join(f"{k}={v:.3f}" for k, v in zip(loss_dict, vals.tolist()))
                    eta = (time.time() - t0) / (it + 1) * (iters_per_epoch - it - 1)
                    print(f"ep {epoch} it {it}/{iters_per_epoch} {msg} lr={optimizer.param_groups[0]['lr']:.2e} "
                          f"eta {eta / 60:.1f}min", flush=True)

        bbox_ap, segm_ap = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: bbox mAP {bbox_ap:.4f} segm mAP {segm_ap:.4f}")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_segm": max(best_segm, segm_ap)}
            torch.save(state, os.path.join(args.workdir, "latest.pth"))
            if segm_ap > best_segm:
                torch.save(state, os.path.join(args.workdir, "best_segm_mAP.pth"))
        best_segm = max(best_segm, segm_ap)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
