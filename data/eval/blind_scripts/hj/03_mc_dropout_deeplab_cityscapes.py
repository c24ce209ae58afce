"""MC-dropout DeepLabV3 on Cityscapes: segmentation + per-pixel uncertainty.

Trains DeepLabV3-ResNet101 with dropout in the ASPP projection and the
decoder, then evaluates with T stochastic forward passes (dropout on, BN in
eval mode) and reports mIoU, pixel ECE and the mean predictive entropy.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 03_mc_dropout_deeplab_cityscapes.py \
        --root /shared/datasets/cityscapes --out /shared/exp/mcd_deeplab
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision.models.segmentation import deeplabv3_resnet101
from torchvision.models import ResNet101_Weights

IGNORE = 255
NUM_CLASSES = 19
# Cityscapes labelIds -> trainIds
ID_TO_TRAIN = np.full(256, IGNORE, dtype=np.uint8)
for lid, tid in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10,
                 24: 11, 25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():
    ID_TO_TRAIN[lid] = tid
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class Cityscapes(Dataset):
    def __init__(self, root, split, crop=None, train=False):
        self.images = sorted(glob.glob(os.path.join(root, "leftImg8bit", split, "*", "*.png")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.images)

    def _label_path(self, p):
        return p.replace("leftImg8bit", "gtFine", 1).replace("_leftImg8bit.png", "_gtFine_labelIds.png")

    def __getitem__(self, i):
        img = Image.open(self.images[i]).convert("RGB")
        lbl = Image.open(self._label_path(self.images[i]))
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img, lbl = img.resize((nw, nh), Image.BILINEAR), lbl.resize((nw, nh), Image.NEAREST)
            if random.random() < 0.5:
                img, lbl = img.transpose(Image.FLIP_LEFT_RIGHT), lbl.transpose(Image.FLIP_LEFT_RIGHT)
        img = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        lbl = ID_TO_TRAIN[np.asarray(lbl)]
        if self.train and self.crop:
            img, lbl = self._random_crop(img, lbl, self.crop)
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.astype(np.int64))

    @staticmethod
    def _random_crop(img, lbl, size):
        h, w = lbl.shape
        ph, pw = max(size - h, 0), max(size - w, 0)
        if ph or pw:
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            h, w = lbl.shape
        y, x = random.randint(0, h - size), random.randint(0, w - size)
        return img[y:y + size, x:x + size], lbl[y:y + size, x:x + size]


def build_model(p_drop):
    model = deeplabv3_resnet101(weights=None, weights_backbone=ResNet101_Weights.IMAGENET1K_V2,
                                num_classes=NUM_CLASSES, aux_loss=False)
    # ASPP projection already has Dropout(0.5); add one before the classifier
    head = model.classifier
    head[4] = nn.Sequential(nn.Dropout2d(p_drop), head[4])
    return model


def enable_mc_dropout(model):
    model.eval()
    for m in model.modules():
        if isinstance(m, (nn.Dropout, nn.Dropout2d)):
            m.train()


@torch.no_grad()
def mc_evaluate(model, loader, device, T, n_bins=15):
    enable_mc_dropout(model)
    conf_mat = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    bins = torch.zeros(3, n_bins, device=device, dtype=torch.float64)  # count, conf, acc
    ent_sum = torch.zeros(2, device=device, dtype=torch.float64)
    for img, lbl in loader:
        img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
        probs = 0
        for _ in range(T):
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)["out"]
            probs = probs + F.softmax(out.float(), dim=1)
        probs = probs / T
        conf, pred = probs.max(1)
        valid = lbl != IGNORE
        idx = lbl[valid] * NUM_CLASSES + pred[valid]
        conf_mat += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
        c, a = conf[valid].double(), pred[valid].eq(lbl[valid]).double()
        b = (c * n_bins).long().clamp_(max=n_bins - 1)
        bins[0].index_add_(0, b, torch.ones_like(c))
        bins[1].index_add_(0, b, c)
        bins[2].index_add_(0, b, a)
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(1)
        ent_sum += torch.stack([ent[valid].double().sum(), valid.sum().double()])
    for t in (conf_mat, bins, ent_sum):
        dist.all_reduce(t)
    iou = conf_mat.diag().float() / (conf_mat.sum(0) + conf_mat.sum(1) - conf_mat.diag()).float().clamp_min(1)
    ece = ((bins[1] - bins[2]).abs().sum() / bins[0].sum()).item()
    return iou.mean().item(), ece, (ent_sum[0] / ent_sum[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="exp/mcd_deeplab")
    ap.add_argument("--iters", type=int, default=40000)
    ap.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--p-drop", type=float, default=0.1)
    ap.add_argument("--mc-samples", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_set = Cityscapes(args.root, "train", crop=args.crop, train=True)
    val_set = Cityscapes(args.root, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    # strided shard without padding so every val image is counted exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), dist.get_world_size())))
    val_loader = DataLoader(val_shard, 1, shuffle=False, num_workers=2)

    model = build_model(args.p_drop).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.named_parameters() if "backbone" in n]
    head = [p for n, p in model.named_parameters() if "backbone" not in n]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr},
                           {"params": head, "lr": args.lr * 10}],
                          lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.iters, power=0.9)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    it, epoch, best = 0, 0, 0.0
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        model.train()
        for img, lbl in train_loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)["out"]
                loss = F.cross_entropy(out, lbl, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"it {it}/{args.iters} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.5f}",
                      flush=True)
            if it % args.eval_every == 0 or it == args.iters:
                miou, ece, ent = mc_evaluate(model.module, val_loader, device, args.mc_samples)
                model.train()
                if rank == 0:
                    print(f"[eval it {it}] mIoU {miou:.4f} ECE {ece:.4f} entropy {ent:.4f}", flush=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "iter": it, "miou": miou}
                    torch.save(state, os.path.join(args.out, "last.pth"))
                    if miou > best:
                        best = miou
                        torch.save(state, os.path.join(args.out, "best.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
