"""SegFormer-B5 on Cityscapes, 1024x1024 crops, sliding-window evaluation.

    torchrun --nproc_per_node=8 05_cityscapes_segformer_b5.py --data /datasets/cityscapes
"""
import argparse
import glob
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import SegformerForSemanticSegmentation

N_CLS = 19
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255

log = logging.getLogger(__name__)


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/cityscapes")
    p.add_argument("--pretrained", default="nvidia/mit-b5")
    p.add_argument("--work-dir", default="work_dirs/segformer_b5_cs_1024")
    p.add_argument("--crop", type=int, default=1024)
    p.add_argument("--bs", type=int, default=1, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--iters", type=int, default=160000)
    p.add_argument("--warmup", type=int, default=1500)
    p.add_argument("--val-every", type=int, default=16000)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class CityscapesFine(Dataset):
    def __init__(self, root, split, crop=1024, train=True):
        self.imgs = sorted(glob.glob(f"{root}/leftImg8bit/{split}/*/*_leftImg8bit.png"))
        self.lbls = [p.replace("/leftImg8bit/", "/gtFine/").replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png")
                     for p in self.imgs]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        lbl = Image.open(self.lbls[i])
        if self.train:
            r = random.uniform(0.5, 2.0)
            size = (int(2048 * r), int(1024 * r))
            img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
            img, lbl = np.asarray(img, np.float32), np.asarray(lbl)
            # cat_max_ratio=0.75: retry crops dominated by a single class
            for _ in range(10):
                y = random.randint(0, max(lbl.shape[0] - self.crop, 0))
                x = random.randint(0, max(lbl.shape[1] - self.crop, 0))
                crop_lbl = lbl[y:y + self.crop, x:x + self.crop]
                cls, cnt = np.unique(crop_lbl[crop_lbl != IGNORE], return_counts=True)
                if len(cnt) > 1 and cnt.max() / cnt.sum() < 0.75:
                    break
            img, lbl = img[y:y + self.crop, x:x + self.crop], crop_lbl
            ph, pw = self.crop - lbl.shape[0], self.crop - lbl.shape[1]
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32), np.asarray(lbl)
        img = (img - MEAN) / STD
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(lbl)).long())


def build_optimizer(model, lr, wd):
    decay, no_decay, head = [], [], []
    for name, p in model.segformer.named_parameters():
        if p.ndim == 1 or "norm" in name or "pos_block" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    head = list(model.decode_head.parameters())
    return torch.optim.AdamW([
        {"params": decay, "weight_decay": wd, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": head, "weight_decay": wd, "lr_scale": 10.0},
    ], lr=lr, betas=(0.9, 0.999))


def sliding_logits(net, img, crop=1024, stride=768):
    b, _, h, w = img.shape
    out = img.new_zeros(b, N_CLS, h, w)
    cnt = img.new_zeros(b, 1, h, w)
    ny = max(h - crop + stride - 1, 0) // stride + 1
    nx = max(w - crop + stride - 1, 0) // stride + 1
    for iy in range(ny):
        for ix in range(nx):
            y1 = min(iy * stride, max(h - crop, 0))
            x1 = min(ix * stride, max(w - crop, 0))
            y2, x2 = min(y1 + crop, h), min(x1 + crop, w)
            logit = net(pixel_values=img[:, :, y1:y2, x1:x2]).logits
            out[:, :, y1:y2, x1:x2] += F.interpolate(logit, size=(y2 - y1, x2 - x1),
                                                     mode="bilinear", align_corners=False)
            cnt[:, :, y1:y2, x1:x2] += 1
    return out / cnt


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    cm = torch.zeros(N_CLS, N_CLS, device=device, dtype=torch.float64)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = sliding_logits(net, img).argmax(1)
        m = lbl != IGNORE
        cm += torch.bincount(lbl[m] * N_CLS + pred[m], minlength=N_CLS * N_CLS).view(N_CLS, N_CLS).double()
    dist.all_reduce(cm)
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag())
    net.train()
    return iou


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    random.seed(100 + rank)
    np.random.seed(100 + rank)

    train_set = CityscapesFine(args.data, "train", args.crop, train=True)
    val_set = CityscapesFine(args.data, "val", train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=1, num_workers=2)

    net = SegformerForSemanticSegmentation.from_pretrained(
        args.pretrained, num_labels=N_CLS, ignore_mismatched_sizes=True, semantic_loss_ignore_index=IGNORE)
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = build_optimizer(model, args.lr, args.wd)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        log.info("train %d / val %d images, %d GPUs", len(train_set), len(val_set), world)

    it, ep, best = 0, 0, 0.0
    model.train()
    while it < args.iters:
        sampler.set_epoch(ep)
        for img, lbl in loader:
            if it < args.warmup:
                lr = args.lr * (1e-6 + (1 - 1e-6) * it / args.warmup)
            else:
                lr = args.lr * (1 - it / args.iters)
            for g in optimizer.param_groups:
                g["lr"] = lr * g["lr_scale"]
            img, lbl = img.to(dev, non_blocking=True), lbl.to(dev, non_blocking=True)
            loss = model(pixel_values=img, labels=lbl).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if it % 50 == 0:
                log.info("it %d/%d loss %.4f lr %.3e", it, args.iters, loss.item(), lr)
            if it % args.val_every == 0 or it == args.iters:
                iou = validate(net, val_loader, dev)
                miou = torch.nanmean(iou).item()
                if rank == 0:
                    log.info("it %d mIoU %.2f | %s", it, 100 * miou,
                             " ".join(f"{100 * v:.1f}" for v in iou.tolist()))
                    torch.save({"state_dict": net.state_dict(), "iter": it},
                               os.path.join(args.work_dir, "iter_last.pth"))
                    if miou > best:
                        best = miou
                        net.save_pretrained(os.path.join(args.work_dir, "best_hf"))
                dist.barrier()
            if it >= args.iters:
                break
        ep += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
