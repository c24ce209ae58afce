"""FCN-ResNet50 on NYUDv2 (40 classes, RGB only), 480x640.

    torchrun --nproc_per_node=4 18_nyuv2_fcn_numpy_hist.py --data /datasets/nyuv2
"""
import argparse
import os
import random
import time

import h5py
import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet50_Weights
from torchvision.models.segmentation import fcn_resnet50

NUM_CLASSES = 40
IGNORE = 255


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/nyuv2")
    ap.add_argument("--out", default="checkpoints/fcn_r50_nyu40")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--crop", type=int, nargs=2, default=[480, 640])
    ap.add_argument("--eval-freq", type=int, default=25)
    return ap.parse_args()


def fast_hist(pred, label, n):
    k = (label >= 0) & (label < n)
    return np.bincount(n * label[k].astype(int) + pred[k], minlength=n ** 2).reshape(n, n)


def per_class_iou(hist):
    return np.diag(hist) / np.maximum(hist.sum(1) + hist.sum(0) - np.diag(hist), 1)


class NYUv2(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, crop, train):
        with h5py.File(os.path.join(root, "nyu_depth_v2_labeled.mat"), "r") as f:
            images = np.array(f["images"]).transpose(0, 3, 2, 1)  # N,H,W,3
        splits = scipy.io.loadmat(os.path.join(root, "splits.mat"))
        idx = (splits["trainNdxs"] if split == "train" else splits["testNdxs"]).ravel() - 1
        labels40 = np.load(os.path.join(root, "labels40.npy"))  # N,H,W with 0 = void, 1..40
        self.images, self.labels = images[idx], labels40[idx]
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(((self.images[i] / 255.0 - self.mean) / self.std).astype(np.float32)).permute(2, 0, 1)
        lbl = self.labels[i].astype(np.int64) - 1
        lbl[lbl < 0] = IGNORE
        lbl = torch.from_numpy(lbl)
        if self.train:
            s = random.uniform(0.5, 1.75)
            h, w = lbl.shape
            nh, nw = int(h * s), int(w * s)
            img = F.interpolate(img[None], (nh, nw), mode="bilinear", align_corners=False)[0]
            lbl = F.interpolate(lbl[None, None].float(), (nh, nw), mode="nearest")[0, 0].long()
            ch, cw = self.crop
            ph, pw = max(ch - nh, 0), max(cw - nw, 0)
            img = F.pad(img, (0, pw, 0, ph), value=0.0)
            lbl = F.pad(lbl, (0, pw, 0, ph), value=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - ch), random.randint(0, lbl.shape[1] - cw)
            img, lbl = img[:, y:y + ch, x:x + cw], lbl[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, lbl = img.flip(-1), lbl.flip(-1)
        return img.contiguous(), lbl.contiguous()


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    hist = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
    for img, lbl in loader:
        out = model(img.to(device))["out"]
        pred = out.argmax(1).cpu().numpy()
        hist += fast_hist(pred.flatten(), lbl.numpy().flatten(), NUM_CLASSES)
    hist = torch.from_numpy(hist)
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.numpy()
    model.train()
    iou = per_class_iou(hist)
    pix_acc = np.diag(hist).sum() / max(hist.sum(), 1)
    return np.nanmean(iou), pix_acc, iou


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    train_set = NYUv2(args.data, "train", tuple(args.crop), True)
    test_set = NYUv2(args.data, "test", tuple(args.crop), False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 4, num_workers=2)

    net = fcn_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                       num_classes=NUM_CLASSES, aux_loss=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD([
        {"params": net.backbone.parameters()},
        {"params": list(net.classifier.parameters()) + list(net.aux_classifier.parameters()), "lr": args.lr * 10},
    ], lr=args.lr, momentum=0.9, weight_decay=1e-4)
    base = [g["lr"] for g in optimizer.param_groups]
    crit = nn.CrossEntropyLoss(ignore_index=IGNORE)
    max_it = args.epochs * len(train_loader)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for img, lbl in train_loader:
            for g, b in zip(optimizer.param_groups, base):
                g["lr"] = b * (1 - it / max_it) ** 0.9
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            out = model(img)
            loss = crit(out["out"], lbl) + 0.5 * crit(out["aux"], lbl)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            it += 1
        if rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1} it {it} loss {loss.item():.4f} ({time.time() - tic:.1f}s/epoch)", flush=True)

        if (epoch + 1) % args.eval_freq == 0 or epoch + 1 == args.epochs:
            miou, acc, _ = test(net, test_loader, device)
            if rank == 0:
                print(f"[test] epoch {epoch + 1}: mIoU {100 * miou:.2f} pixAcc {100 * acc:.2f}", flush=True)
                torch.save({"epoch": epoch + 1, "model": net.state_dict()}, os.path.join(args.out, "last.pth"))
                if miou > best:
                    best = miou
                    torch.save({"epoch": epoch + 1, "model": net.state_dict()}, os.path.join(args.out, "best.pth"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
