"""
ISPRS Potsdam semantic labelling (6 classes) with DeepLabV3+ (ResNet-101),
IRRG tiles cut to 512x512 with tools/cut_potsdam.py. Preemptible cluster:
the job auto-resumes from <work-dir>/last.pth when it is restarted.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        train_potsdam.py --data /shared/potsdam_512 --work-dir /shared/exp/potsdam_dlv3p
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

# impervious, building, low veg, tree, car, clutter
PALETTE = np.array([[255, 255, 255], [0, 0, 255], [0, 255, 255], [0, 255, 0], [255, 255, 0], [255, 0, 0]])
NUM_CLASSES = 6


def rgb_to_label(rgb):
    lab = np.full(rgb.shape[:2], 255, np.uint8)
    for i, c in enumerate(PALETTE):
        lab[(rgb == c).all(-1)] = i
    return lab


class PotsdamTiles(Dataset):
    def __init__(self, root, split, train):
        self.img_dir = os.path.join(root, split, "img")
        self.ann_dir = os.path.join(root, split, "ann")
        self.names = sorted(os.listdir(self.img_dir))
        self.train = train
        self.mean = np.array([0.337, 0.361, 0.338], np.float32)
        self.std = np.array([0.140, 0.138, 0.143], np.float32)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        img = np.asarray(Image.open(os.path.join(self.img_dir, n)).convert("RGB"), np.float32) / 255.0
        lab = rgb_to_label(np.asarray(Image.open(os.path.join(self.ann_dir, n)).convert("RGB")))
        if self.train:
            if np.random.rand() < 0.5:
                img, lab = img[:, ::-1], lab[:, ::-1]
            if np.random.rand() < 0.5:
                img, lab = img[::-1], lab[::-1]
            img = img * np.random.uniform(0.9, 1.1) + np.random.uniform(-0.05, 0.05)
        img = ((img - self.mean) / self.std).transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(img, np.float32)), torch.from_numpy(np.ascontiguousarray(lab)).long()


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=4000)
    p.add_argument("--ckpt-interval", type=int, default=2000)
    return p.parse_args()


def save_checkpoint(path, model, optimizer, it, best):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "iter": it, "best_miou": best}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for img, lab in loader:
        img, lab = img.to(device), lab.to(device)
        pred = model(img).argmax(1)
        k = lab != 255
        hist += torch.bincount(NUM_CLASSES * lab[k] + pred[k], minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    f1 = 2 * hist.diag() / (hist.sum(0) + hist.sum(1)).clamp(min=1)
    model.train()
    # clutter is usually excluded from the reported Potsdam mIoU / mF1
    return iou[:5].float().mean().item(), f1[:5].float().mean().item(), (hist.diag().sum() / hist.sum()).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = PotsdamTiles(args.data, "train", train=True)
    val_ds = PotsdamTiles(args.data, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 8, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers)

    model = smp.DeepLabV3Plus("resnet101", encoder_weights="imagenet", classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    start_iter, best_miou = 0, 0.0
    last_path = os.path.join(args.work_dir, "last.pth")
    if os.path.isfile(last_path):
        ckpt = torch.load(last_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_iter, best_miou = ckpt["iter"], ckpt["best_miou"]
        if rank == 0:
            print(f"resuming from iter {start_iter} (best mIoU {best_miou:.4f})", flush=True)

    model = DDP(model, device_ids=[local_rank])
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.iters, power=0.9,
                                                      last_epoch=start_iter - 1 if start_iter else -1)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    it = start_iter
    epoch = it // len(train_dl)
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = criterion(model(img), lab)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"iter {it}/{args.iters} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_interval == 0:
                miou, mf1, oa = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"[eval] iter {it} mIoU {miou:.4f} mF1 {mf1:.4f} OA {oa:.4f}", flush=True)
                    if miou > best_miou:
                        best_miou = miou
                        torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best_miou.pth"))
            if it % args.ckpt_interval == 0 and rank == 0:
                save_checkpoint(last_path, model, optimizer, it, best_miou)
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        save_checkpoint(last_path, model, optimizer, it, best_miou)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
