"""BiSeNetV1 (R-18 context path) on BDD100K semantic segmentation, fp16 AMP,
gradient accumulation, wandb logging.

    torchrun --nproc_per_node=4 11_bdd100k_bisenet_amp.py --root /datasets/bdd100k/seg --accum 2
"""
import argparse
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 19
IGNORE = 255


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets/bdd100k/seg")
    p.add_argument("--out", default="runs/bisenet_r18_bdd")
    p.add_argument("--crop", type=int, nargs=2, default=[512, 1024])
    p.add_argument("--bs", type=int, default=8, help="per GPU micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=0.01, help="for an effective batch of 16")
    p.add_argument("--iters", type=int, default=60000, help="optimizer steps")
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--project", default="rt-seg")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args()


class BDDSeg(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, crop, train):
        self.img_dir = os.path.join(root, "images", split)
        self.lbl_dir = os.path.join(root, "labels", split)
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        lbl = Image.open(os.path.join(self.lbl_dir, self.names[i] + "_train_id.png"))
        if self.train:
            s = random.uniform(0.75, 2.0)
            size = (int(img.width * s), int(img.height * s))
            img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl)
            ch, cw = self.crop
            ph, pw = max(ch - lbl.shape[0], 0), max(cw - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - ch), random.randint(0, lbl.shape[1] - cw)
            img, lbl = img[y:y + ch, x:x + cw], lbl[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.astype(np.int64))


def cbr(i, o, k=3, s=1):
    return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))


class ARM(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.conv = cbr(i, o)
        self.att = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(o, o, 1, bias=False), nn.BatchNorm2d(o), nn.Sigmoid())

    def forward(self, x):
        x = self.conv(x)
        return x * self.att(x)


class BiSeNet(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.spatial = nn.Sequential(cbr(3, 64, 7, 2), cbr(64, 64, 3, 2), cbr(64, 64, 3, 2), cbr(64, 128, 1))
        self.context = timm.create_model("resnet18", pretrained=True, features_only=True, out_indices=(3, 4))
        self.arm16, self.arm32 = ARM(256, 128), ARM(512, 128)
        self.gp = nn.Sequential(nn.AdaptiveAvgPool2d(1), cbr(512, 128, 1))
        self.refine16, self.refine32 = cbr(128, 128), cbr(128, 128)
        self.ffm = cbr(256, 256, 1)
        self.ffm_att = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(256, 64, 1), nn.ReLU(inplace=True),
                                     nn.Conv2d(64, 256, 1), nn.Sigmoid())
        self.head = nn.Sequential(cbr(256, 256), nn.Conv2d(256, n, 1))
        self.aux16 = nn.Sequential(cbr(128, 64), nn.Conv2d(64, n, 1))
        self.aux32 = nn.Sequential(cbr(128, 64), nn.Conv2d(64, n, 1))

    def forward(self, x):
        H, W = x.shape[-2:]
        sp = self.spatial(x)
        c16, c32 = self.context(x)
        a32 = self.arm32(c32) + self.gp(c32)
        a32 = self.refine32(F.interpolate(a32, size=c16.shape[-2:], mode="nearest"))
        a16 = self.refine16(F.interpolate(self.arm16(c16) + a32, size=sp.shape[-2:], mode="nearest"))
        f = self.ffm(torch.cat([sp, a16], 1))
        f = f + f * self.ffm_att(f)
        up = lambda t: F.interpolate(t, size=(H, W), mode="bilinear", align_corners=False)
        out = up(self.head(f))
        if self.training:
            return out, up(self.aux16(a16)), up(self.aux32(a32))
        return out


def seg_loss(logits, target):
    # mean over labelled pixels; crops that are entirely ignore contribute a zero loss
    valid = (target != IGNORE).sum()
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction="sum") / valid.clamp(min=1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES ** 2, device=device, dtype=torch.int64)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = net(img).argmax(1)
        m = lbl != IGNORE
        hist += torch.bincount(lbl[m] * NUM_CLASSES + pred[m], minlength=NUM_CLASSES ** 2)
    dist.all_reduce(hist)
    h = hist.view(NUM_CLASSES, NUM_CLASSES).double()
    net.train()
    return h.diag() / (h.sum(0) + h.sum(1) - h.diag())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True
    random.seed(rank)
    torch.manual_seed(0)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not args.no_wandb:
            run = wandb.init(project=args.project, config=vars(args), dir=args.out)

    train_ds = BDDSeg(args.root, "train", tuple(args.crop), True)
    val_ds = BDDSeg(args.root, "val", None, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(BiSeNet(NUM_CLASSES)).to(device)
    model = DDP(net, device_ids=[local_rank])
    eff_batch = args.bs * args.accum * world
    lr = args.base_lr * eff_batch / 16
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        print(f"effective batch {eff_batch}, lr {lr:.4f}", flush=True)

    step, epoch, best = 0, 0, 0.0
    micro = 0
    t0 = time.time()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            micro += 1
            sync = micro % args.accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    out, a16, a32 = model(img)
                loss = seg_loss(out, lbl) + seg_loss(a16, lbl) + seg_loss(a32, lbl)
                scaler.scale(loss / args.accum).backward()
            if not sync:
                continue
            for g in optimizer.param_groups:
                g["lr"] = lr * (1 - step / args.iters) ** 0.9
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                msg = {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"], "scale": scaler.get_scale(),
                       "sec_per_step": (time.time() - t0) / 50}
                print(f"step {step} " + " ".join(f"{k}={v:.4g}" for k, v in msg.items()), flush=True)
                if run is not None:
                    run.log(msg, step=step)
                t0 = time.time()
            if step % args.eval_every == 0 or step == args.iters:
                iou = evaluate(net, val_loader, device)
                miou = torch.nanmean(iou).item()
                if rank == 0:
                    print(f"step {step} mIoU {100 * miou:.2f}", flush=True)
                    if run is not None:
                        run.log({"val/mIoU": miou}, step=step)
                    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "step": step}
                    torch.save(state, os.path.join(args.out, "last.pt"))
                    if miou > best:
                        best = miou
                        torch.save(state, os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.iters:
                break
        epoch += 1

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
