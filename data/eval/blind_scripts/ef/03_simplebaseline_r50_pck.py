"""SimpleBaseline (ResNet-50 + 3 deconv) on the court-side keypoint set.

Validation metric is PCK@0.2 of the box diagonal, which is what the coaching
dashboard reports. Annotations are COCO-keypoint json exported from CVAT.

    torchrun --standalone --nproc_per_node=4 simplebaseline_r50_pck.py \
        --train-ann /data/courtside/ann/train.json --val-ann /data/courtside/ann/val.json \
        --img-dir /data/courtside/frames --out /data/exp/sb_r50
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import affine_transform, get_affine_transform

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def get_args():
    ap = argparse.ArgumentParser("simplebaseline")
    ap.add_argument("--train-ann", required=True)
    ap.add_argument("--val-ann", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--out", default="exp/sb_r50")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--pck-thr", type=float, default=0.2)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class PoseResNet(nn.Module):
    def __init__(self, depth=50, num_joints=17, deconv_ch=256):
        super().__init__()
        resnet = getattr(torchvision.models, f"resnet{depth}")(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        in_ch = 2048 if depth >= 50 else 512
        layers = []
        for _ in range(3):
            layers += [nn.ConvTranspose2d(in_ch, deconv_ch, 4, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(deconv_ch), nn.ReLU(inplace=True)]
            in_ch = deconv_ch
        self.deconv_layers = nn.Sequential(*layers)
        self.final_layer = nn.Conv2d(deconv_ch, num_joints, 1)
        for m in self.deconv_layers.modules():
            if isinstance(m, nn.ConvTranspose2d):
                nn.init.normal_(m.weight, std=0.001)
        nn.init.normal_(self.final_layer.weight, std=0.001)
        nn.init.zeros_(self.final_layer.bias)

    def forward(self, x):
        return self.final_layer(self.deconv_layers(self.backbone(x)))


def max_preds(hm):
    b, k, h, w = hm.shape
    flat = hm.reshape(b, k, -1)
    idx = flat.argmax(-1)
    val = flat.max(-1)
    xy = np.stack([idx % w, idx // w], -1).astype(np.float32)
    xy[val <= 0] = 0
    return xy, val


def heatmap_accuracy(output, target, thr=0.5):
    """HRNet-style training accuracy: PCK in heatmap space, normalised by hm size / 10."""
    pred, _ = max_preds(output)
    gt, _ = max_preds(target)
    h, w = output.shape[2:]
    norm = np.array([h, w], dtype=np.float32) / 10
    dists = np.linalg.norm((pred - gt) / norm, axis=-1)
    valid = (gt[..., 0] > 1) & (gt[..., 1] > 1)
    hits = (dists < thr) & valid
    return float(hits.sum()), float(valid.sum())


def pck_on_image(heat, meta, thr):
    pred, _ = max_preds(heat)
    hits, total = 0.0, 0.0
    for n in range(heat.shape[0]):
        trans = get_affine_transform(meta["center"][n].numpy(), meta["scale"][n].numpy(), 0,
                                     [heat.shape[3], heat.shape[2]], inv=1)
        gt = meta["joints"][n].numpy()
        vis = meta["vis"][n].numpy() > 0
        bw, bh = meta["bbox"][n].numpy()[2:]
        diag = np.sqrt(bw ** 2 + bh ** 2)
        for j in np.nonzero(vis)[0]:
            p = affine_transform(pred[n, j], trans)
            hits += float(np.linalg.norm(p - gt[j]) < thr * diag)
            total += 1
    return hits, total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    train_set = TopDownCocoDataset(None, args.train_ann, args.img_dir, image_size=[192, 256], sigma=2,
                                   flip_pairs=FLIP_PAIRS, train=True)
    val_set = TopDownCocoDataset(None, args.val_ann, args.img_dir, image_size=[192, 256], sigma=2,
                                 flip_pairs=FLIP_PAIRS, train=False, return_gt=True)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = PoseResNet(args.depth)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [90, 120], 0.1)
    mse = nn.MSELoss()

    start = 0
    best_pck = 0.0
    if args.resume:
        sd = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])
        start, best_pck = sd["epoch"] + 1, sd["best_pck"]

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_acc = torch.zeros(2, device=dev)
        hit_sum, cnt_sum = 0.0, 0.0
        for it, (img, target, tw, _) in enumerate(train_loader):
            img, target, tw = img.to(dev, non_blocking=True), target.to(dev, non_blocking=True), tw.to(dev, non_blocking=True)
            out = model(img)
            loss = 0.5 * mse(out * tw.unsqueeze(-1), target * tw.unsqueeze(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=dev)])
            h, c = heatmap_accuracy(out.detach().cpu().numpy(), target.cpu().numpy())
            hit_sum += h
            cnt_sum += c
        sched.step()

        acc_stats = torch.tensor([hit_sum, cnt_sum], dtype=torch.float64)
        dist.all_reduce(acc_stats)
        dist.all_reduce(loss_acc)
        if rank == 0:
            train_acc = (acc_stats[0] / acc_stats[1].clamp(min=1)).item()
            writer.add_scalar("train/loss", (loss_acc[0] / loss_acc[1]).item(), epoch)
            writer.add_scalar("train/hm_acc", train_acc, epoch)
            print(f"[{epoch}] loss {(loss_acc[0] / loss_acc[1]).item():.5f} acc {train_acc:.3f} "
                  f"{time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % 5 == 0:
            model.eval()
            pck = torch.zeros(2, device=dev)
            with torch.no_grad():
                for img, _, _, meta in val_loader:
                    heat = model(img.to(dev, non_blocking=True)).cpu().numpy()
                    h, t = pck_on_image(heat, meta, args.pck_thr)
                    pck += torch.tensor([h, t], device=dev)
            dist.all_reduce(pck)
            val_pck = (pck[0] / pck[1].clamp(min=1)).item()
            if rank == 0:
                writer.add_scalar("val/pck", val_pck, epoch)
                print(f"[{epoch}] val PCK@{args.pck_thr}: {val_pck:.4f}", flush=True)
                if val_pck > best_pck:
                    best_pck = val_pck
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "best_pck": best_pck}, os.path.join(args.out, "last.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
