"""Semi-supervised semantic segmentation on PASCAL VOC 2012 with a mean teacher.

The EMA teacher predicts on the weakly augmented unlabelled crop; pixels whose
teacher confidence exceeds --conf-thresh supervise the student's prediction on the
photometrically perturbed crop.

    torchrun --nproc_per_node=4 13_meanteacher_voc_seg.py --labeled-list splits/1464/labeled.txt \
        --unlabeled-list splits/1464/unlabeled.txt --resume exp/voc_mt/last.pth
"""
import argparse
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.transforms import functional as TF

NUM_CLASSES, IGNORE = 21, 255
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--voc-root", default="/data/VOCdevkit/VOC2012")
    p.add_argument("--labeled-list", default="splits/1464/labeled.txt")
    p.add_argument("--unlabeled-list", default="splits/1464/unlabeled.txt")
    p.add_argument("--val-list", default="splits/val.txt")
    p.add_argument("--out", default="exp/voc_mt")
    p.add_argument("--crop", type=int, default=513)
    p.add_argument("--batch-size", type=int, default=4, help="labelled and unlabelled images per GPU each")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--lr-head-mult", type=float, default=10.0)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--conf-thresh", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_list(path):
    with open(path) as f:
        return [line.strip().split()[0] for line in f if line.strip()]


class VOCSemi(Dataset):
    def __init__(self, root, ids, crop, mode):
        self.root, self.ids, self.crop, self.mode = root, ids, crop, mode
        self.jitter = transforms.ColorJitter(0.5, 0.5, 0.5, 0.25)

    def __len__(self):
        return len(self.ids)

    def _norm(self, img):
        return TF.normalize(TF.to_tensor(img), MEAN, STD)

    def __getitem__(self, i):
        name = self.ids[i]
        img = Image.open(os.path.join(self.root, "JPEGImages", name + ".jpg")).convert("RGB")
        if self.mode == "val":
            mask = Image.open(os.path.join(self.root, "SegmentationClassAug", name + ".png"))
            return self._norm(img), torch.from_numpy(np.array(mask)).long()
        mask = (Image.open(os.path.join(self.root, "SegmentationClassAug", name + ".png"))
                if self.mode == "label" else Image.fromarray(np.zeros(img.size[::-1], dtype=np.uint8)))
        # random scale, pad, crop, flip (applied jointly to image and mask)
        s = random.uniform(0.5, 2.0)
        w, h = img.size
        nw, nh = int(w * s), int(h * s)
        img, mask = img.resize((nw, nh), Image.BILINEAR), mask.resize((nw, nh), Image.NEAREST)
        pw, ph = max(self.crop - nw, 0), max(self.crop - nh, 0)
        img = TF.pad(img, [0, 0, pw, ph], fill=0)
        mask = TF.pad(mask, [0, 0, pw, ph], fill=IGNORE)
        x0, y0 = random.randint(0, img.size[0] - self.crop), random.randint(0, img.size[1] - self.crop)
        img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        mask = mask.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        if random.random() < 0.5:
            img, mask = TF.hflip(img), TF.hflip(mask)
        if self.mode == "label":
            return self._norm(img), torch.from_numpy(np.array(mask)).long()
        strong = self.jitter(img) if random.random() < 0.8 else img
        if random.random() < 0.2:
            strong = transforms.RandomGrayscale(p=1.0)(strong)
        if random.random() < 0.5:
            strong = strong.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))
        ignore = torch.from_numpy(np.array(mask)).long()  # 255 where the crop is padding
        return self._norm(img), self._norm(strong), ignore


def build_model():
    net = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=NUM_CLASSES,
                             aux_loss=False)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


@torch.no_grad()
def ema_update(teacher, student, decay):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(decay).add_(s.detach(), alpha=1 - decay)
    for t, s in zip(teacher.buffers(), student.buffers()):
        t.copy_(s)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.float64)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = net(img)["out"].argmax(1)
        valid = mask != IGNORE
        hist += torch.bincount(NUM_CLASSES * mask[valid] + pred[valid],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    return iou.mean().item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    lab_ids, unl_ids = read_list(args.labeled_list), read_list(args.unlabeled_list)
    # repeat the labelled ids so that one pass over them matches one pass over the unlabelled ids
    lab_ids = (lab_ids * math.ceil(len(unl_ids) / len(lab_ids)))[: len(unl_ids)]
    lab_set = VOCSemi(args.voc_root, lab_ids, args.crop, "label")
    unl_set = VOCSemi(args.voc_root, unl_ids, args.crop, "unlabel")
    val_ids = read_list(args.val_list)
    val_set = VOCSemi(args.voc_root, val_ids[rank::world], args.crop, "val")

    lab_sampler = DistributedSampler(lab_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, args.batch_size, sampler=unl_sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=2)

    if rank == 0:
        build_model()  # downloads the ImageNet backbone weights into the hub cache
    dist.barrier()
    student = build_model().to(device)
    teacher = deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = DDP(student, device_ids=[local_rank])

    head = list(student.module.classifier.parameters())
    head_ids = {id(p) for p in head}
    backbone = [p for p in student.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.SGD([{"params": backbone, "lr": args.lr},
                                 {"params": head, "lr": args.lr * args.lr_head_mult}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(unl_loader)
    total_iters = args.epochs * iters_per_epoch

    start_epoch, best_miou = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        student.module.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_miou = ckpt["epoch"], ckpt["best_miou"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        lab_sampler.set_epoch(epoch)
        unl_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, ((x, y), (u_w, u_s, u_ignore)) in enumerate(zip(lab_loader, unl_loader)):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            u_w, u_s = u_w.to(device, non_blocking=True), u_s.to(device, non_blocking=True)
            u_ignore = u_ignore.to(device, non_blocking=True)

            it = epoch * iters_per_epoch + i
            factor = (1 - it / total_iters) ** 0.9
            optimizer.param_groups[0]["lr"] = args.lr * factor
            optimizer.param_groups[1]["lr"] = args.lr * args.lr_head_mult * factor

            with torch.no_grad():
                prob_t = teacher(u_w)["out"].softmax(1)
                conf, pseudo = prob_t.max(1)
                pseudo[u_ignore == IGNORE] = IGNORE

            out = student(torch.cat([x, u_s]))["out"]
            out_x, out_u = out[: x.size(0)], out[x.size(0):]
            loss_x = F.cross_entropy(out_x, y, ignore_index=IGNORE)
            pix = F.cross_entropy(out_u, pseudo, ignore_index=IGNORE, reduction="none")
            mask = ((conf >= args.conf_thresh) & (u_ignore != IGNORE)).float()
            loss_u = (pix * mask).sum() / (u_ignore != IGNORE).sum().clamp(min=1)
            loss = loss_x + args.lambda_u * loss_u

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema_update(teacher, student.module, min(1 - 1 / (it + 1), args.ema))

            if rank == 0 and i % 20 == 0:
                print(f"ep {epoch} [{i}/{iters_per_epoch}] loss_x {loss_x.item():.4f} loss_u {loss_u.item():.4f} "
                      f"mask {mask.mean().item():.3f} lr {optimizer.param_groups[0]['lr']:.6f}", flush=True)

        miou = evaluate(teacher, val_loader, device)
        if rank == 0:
            state = {"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                     "best_miou": max(best_miou, miou)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if miou > best_miou:
                torch.save(teacher.state_dict(), os.path.join(args.out, "best_teacher.pth"))
            print(f"epoch {epoch}: teacher mIoU {miou:.2f} (best {max(best_miou, miou):.2f}) "
                  f"{time.time() - t0:.0f}s", flush=True)
        best_miou = max(best_miou, miou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
