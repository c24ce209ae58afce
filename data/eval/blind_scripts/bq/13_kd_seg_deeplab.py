"""Pixel-wise distillation for semantic segmentation on Pascal VOC 2012 (aug).

Teacher: DeepLabV3-ResNet101 (torchvision, COCO-with-VOC-labels weights), frozen.
Student: DeepLabV3-MobileNetV3-Large trained from an ImageNet backbone.
The student's BatchNorms are converted to SyncBatchNorm because each GPU only sees
8 crops; gradients are accumulated over --accum micro-batches with no_sync().

    torchrun --nproc_per_node=8 13_kd_seg_deeplab.py --voc-root /data/VOCdevkit/.. --out runs/seg_kd
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from contextlib import nullcontext
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import VOCSegmentation
from torchvision.models import MobileNet_V3_Large_Weights
from torchvision.models.segmentation import (DeepLabV3_ResNet101_Weights, deeplabv3_mobilenet_v3_large,
                                             deeplabv3_resnet101)

NUM_CLASSES = 21
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class JointTrainTransform:
    def __init__(self, crop=512, scale=(0.5, 2.0)):
        self.crop, self.scale = crop, scale

    def __call__(self, img, mask):
        s = random.uniform(*self.scale)
        w, h = img.size
        nw, nh = int(w * s), int(h * s)
        img = img.resize((nw, nh), Image.BILINEAR)
        mask = mask.resize((nw, nh), Image.NEAREST)
        pad_w, pad_h = max(self.crop - nw, 0), max(self.crop - nh, 0)
        if pad_w or pad_h:
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            mask = TF.pad(mask, [0, 0, pad_w, pad_h], fill=255)
        i = random.randint(0, img.size[1] - self.crop)
        j = random.randint(0, img.size[0] - self.crop)
        img, mask = TF.crop(img, i, j, self.crop, self.crop), TF.crop(mask, i, j, self.crop, self.crop)
        if random.random() < 0.5:
            img, mask = TF.hflip(img), TF.hflip(mask)
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(mask), dtype=torch.long)


class JointEvalTransform:
    def __call__(self, img, mask):
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(mask), dtype=torch.long)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voc-root", required=True)
    ap.add_argument("--out", default="runs/seg_kd")
    ap.add_argument("--iters", type=int, default=30000, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8, help="crops per GPU per micro-batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--kd-weight", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=3000)
    return ap.parse_args()


def pixel_kd(s_logits, t_logits, target, tau):
    valid = (target != 255).float()
    kl = F.kl_div(F.log_softmax(s_logits / tau, 1), F.softmax(t_logits / tau, 1), reduction="none").sum(1)
    return (kl * valid).sum() / valid.sum().clamp(min=1) * tau * tau


@torch.no_grad()
def evaluate(model, loader, device):
    was_training = model.training
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = model(img)["out"].argmax(1)
        k = mask != 255
        conf += torch.bincount(mask[k] * NUM_CLASSES + pred[k], minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, -1)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train(was_training)
    return iou.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = VOCSegmentation(args.voc_root, year="2012", image_set="train", transforms=JointTrainTransform())
    val_set = VOCSegmentation(args.voc_root, year="2012", image_set="val", transforms=JointEvalTransform())
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    # full-resolution images have different sizes -> batch 1, unpadded strided shard per rank
    val_dl = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1, num_workers=4)

    teacher = deeplabv3_resnet101(weights=DeepLabV3_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1)
    teacher = teacher.to(device).eval().requires_grad_(False)

    student = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=MobileNet_V3_Large_Weights.IMAGENET1K_V1,
                                           num_classes=NUM_CLASSES, aux_loss=False)
    student = torch.nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank])

    params = [
        {"params": student.module.backbone.parameters(), "lr": args.lr * 0.1},
        {"params": student.module.classifier.parameters(), "lr": args.lr},
    ]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.iters, power=0.9)

    t_miou = evaluate(teacher, val_dl, device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"teacher mIoU {t_miou:.4f}")

    step, epoch, best = 0, 0, 0.0
    t0 = time.time()
    student.train()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for micro, (img, mask) in enumerate(train_dl):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            last_micro = (micro + 1) % args.accum == 0
            with torch.no_grad():
                t_out = teacher(img)["out"]
            with (nullcontext() if last_micro else student.no_sync()):
                s_out = student(img)["out"]
                ce = F.cross_entropy(s_out, mask, ignore_index=255)
                kd = pixel_kd(s_out, t_out, mask, args.tau)
                loss = (ce + args.kd_weight * kd) / args.accum
                loss.backward()
            if not last_micro:
                continue
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step}/{args.iters} ce {ce.item():.4f} kd {kd.item():.4f} "
                      f"{(time.time() - t0) / step:.2f}s/step")
            if step % args.eval_every == 0 or step == args.iters:
                miou = evaluate(student.module, val_dl, device)
                if rank == 0:
                    print(f"step {step}: student mIoU {miou:.4f}")
                    ckpt = {"model": student.module.state_dict(), "step": step, "miou": miou}
                    torch.save(ckpt, os.path.join(args.out, "last.pth"))
                    if miou > best:
                        best = miou
                        torch.save(ckpt, os.path.join(args.out, "best.pth"))
            if step >= args.iters:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        print(f"done, best student mIoU {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
