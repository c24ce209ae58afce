"""PSPNet (dilated ResNet-50) on CamVid, 11 classes + void.

Epoch-based schedule (CamVid is small): 200 epochs, poly lr per iteration,
auxiliary FCN head on layer3 with weight 0.4.

    torchrun --standalone --nproc_per_node=4 06_camvid_pspnet.py --root /datasets/CamVid
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models

CLASSES = ["Sky", "Building", "Pole", "Road", "Sidewalk", "Tree",
           "SignSymbol", "Fence", "Car", "Pedestrian", "Bicyclist"]
IGNORE = 11  # "Unlabelled" in the SegNet-style CamVid annotations


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/CamVid")
    ap.add_argument("--save-dir", default="checkpoints/pspnet_r50_camvid")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4, help="per process")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--crop", type=int, nargs=2, default=[360, 480])
    ap.add_argument("--aux-weight", type=float, default=0.4)
    ap.add_argument("--val-freq", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class CamVid(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, crop=(360, 480), train=True):
        self.img_dir = os.path.join(root, split)
        self.lbl_dir = os.path.join(root, split + "annot")
        self.files = sorted(os.listdir(self.img_dir))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.files[i])).convert("RGB")
        lbl = Image.open(os.path.join(self.lbl_dir, self.files[i]))
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img, lbl = img.resize((nw, nh), Image.BILINEAR), lbl.resize((nw, nh), Image.NEAREST)
            img, lbl = np.asarray(img, np.float32) / 255.0, np.asarray(lbl, np.int64)
            ch, cw = self.crop
            ph, pw = max(ch - nh, 0), max(cw - nw, 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y = random.randint(0, lbl.shape[0] - ch)
            x = random.randint(0, lbl.shape[1] - cw)
            img, lbl = img[y:y + ch, x:x + cw], lbl[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32) / 255.0, np.asarray(lbl, np.int64)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


class PPM(nn.Module):
    def __init__(self, in_ch, bins=(1, 2, 3, 6)):
        super().__init__()
        red = in_ch // len(bins)
        self.stages = nn.ModuleList([
            nn.Sequential(nn.AdaptiveAvgPool2d(b), nn.Conv2d(in_ch, red, 1, bias=False),
                          nn.BatchNorm2d(red), nn.ReLU(inplace=True)) for b in bins])

    def forward(self, x):
        h, w = x.shape[-2:]
        return torch.cat([x] + [F.interpolate(s(x), (h, w), mode="bilinear", align_corners=True)
                                for s in self.stages], 1)


class PSPNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1,
                            replace_stride_with_dilation=[False, True, True])
        self.layer0 = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.ppm = PPM(2048)
        self.cls = nn.Sequential(nn.Conv2d(4096, 512, 3, padding=1, bias=False), nn.BatchNorm2d(512),
                                 nn.ReLU(inplace=True), nn.Dropout2d(0.1), nn.Conv2d(512, n_classes, 1))
        self.aux = nn.Sequential(nn.Conv2d(1024, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256),
                                 nn.ReLU(inplace=True), nn.Dropout2d(0.1), nn.Conv2d(256, n_classes, 1))

    def forward(self, x):
        size = x.shape[-2:]
        x = self.layer2(self.layer1(self.layer0(x)))
        c3 = self.layer3(x)
        c4 = self.layer4(c3)
        out = F.interpolate(self.cls(self.ppm(c4)), size, mode="bilinear", align_corners=True)
        if self.training:
            aux = F.interpolate(self.aux(c3), size, mode="bilinear", align_corners=True)
            return out, aux
        return out


@torch.no_grad()
def validate(model, loader, device, n=len(CLASSES)):
    model.eval()
    inter = torch.zeros(n, device=device, dtype=torch.float64)
    union = torch.zeros(n, device=device, dtype=torch.float64)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = model(img).argmax(1)
        valid = lbl != IGNORE
        p, t = pred[valid], lbl[valid]
        area_i = torch.bincount(t[p == t], minlength=n).double()
        inter += area_i
        union += torch.bincount(p, minlength=n).double() + torch.bincount(t, minlength=n).double() - area_i
    dist.all_reduce(inter)
    dist.all_reduce(union)
    model.train()
    return (inter / union.clamp(min=1)).cpu()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    train_ds = CamVid(args.root, "train", tuple(args.crop), train=True)
    val_ds = CamVid(args.root, "val", train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=1,
                            num_workers=2, pin_memory=True)

    net = PSPNet(len(CLASSES))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda(local_rank)
    model = DDP(net, device_ids=[local_rank])

    new_params = [p for m in (net.ppm, net.cls, net.aux) for p in m.parameters()]
    new_ids = {id(p) for p in new_params}
    base_params = [p for p in net.parameters() if id(p) not in new_ids]
    optimizer = torch.optim.SGD([{"params": base_params, "lr": args.lr},
                                 {"params": new_params, "lr": args.lr * 10}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    max_iter = args.epochs * len(train_loader)
    cur_iter, best_miou = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, lbl in train_loader:
            factor = (1 - cur_iter / max_iter) ** 0.9
            optimizer.param_groups[0]["lr"] = args.lr * factor
            optimizer.param_groups[1]["lr"] = args.lr * 10 * factor
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            out, aux = model(img)
            loss = criterion(out, lbl) + args.aux_weight * criterion(aux, lbl)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cur_iter += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} time {time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % args.val_freq == 0 or epoch + 1 == args.epochs:
            iou = validate(net, val_loader, device)
            miou = iou.mean().item()
            if rank == 0:
                print("  " + "  ".join(f"{c}:{v * 100:.1f}" for c, v in zip(CLASSES, iou.tolist())))
                print(f"  mIoU {miou * 100:.2f} (best {max(best_miou, miou) * 100:.2f})", flush=True)
                ckpt = {"epoch": epoch + 1, "state_dict": net.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(ckpt, os.path.join(args.save_dir, "last.pth"))
                if miou > best_miou:
                    torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
            best_miou = max(best_miou, miou)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
