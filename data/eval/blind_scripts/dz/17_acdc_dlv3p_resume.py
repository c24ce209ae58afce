"""DeepLabV3+ R-101 on ACDC (adverse-condition driving, Cityscapes label space).

Long jobs on the shared cluster get preempted, so training auto-resumes from
<work_dir>/latest.pth when it exists.

    torchrun --nproc_per_node=8 17_acdc_dlv3p_resume.py --root /datasets/acdc --work-dir /shared/exp/acdc_dlv3p
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N = 19
IGNORE = 255
CONDITIONS = ("fog", "night", "rain", "snow")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets/acdc")
    p.add_argument("--work-dir", default="/shared/exp/acdc_dlv3p")
    p.add_argument("--crop", type=int, default=1024)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--max-iters", type=int, default=40000)
    p.add_argument("--ckpt-every", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=4000)
    return p.parse_args()


class ACDC(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, crop, train):
        self.imgs = []
        for c in CONDITIONS:
            self.imgs += sorted(glob.glob(f"{root}/rgb_anon/{c}/{split}/*/*_rgb_anon.png"))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        p = self.imgs[i]
        img = Image.open(p).convert("RGB")
        lbl = Image.open(p.replace("/rgb_anon/", "/gt/").replace("_rgb_anon.png", "_gt_labelTrainIds.png"))
        if self.train:
            s = random.uniform(0.5, 2.0)
            size = (int(img.width * s), int(img.height * s))
            img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl, np.int64)
            ph, pw = max(self.crop - lbl.shape[0], 0), max(self.crop - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - self.crop), random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl, np.int64)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


@torch.no_grad()
def slide_eval(net, loader, device, crop=1024, stride=768):
    net.eval()
    hist = torch.zeros(N, N, dtype=torch.float64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        _, _, H, W = img.shape
        acc = torch.zeros(1, N, H, W, device=device)
        cnt = torch.zeros(1, 1, H, W, device=device)
        for y in sorted(set(list(range(0, H - crop, stride)) + [H - crop])):
            for x in sorted(set(list(range(0, W - crop, stride)) + [W - crop])):
                acc[..., y:y + crop, x:x + crop] += net(img[..., y:y + crop, x:x + crop]).softmax(1)
                cnt[..., y:y + crop, x:x + crop] += 1
        pred = (acc / cnt).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * N + pred[k], minlength=N * N).view(N, N).double()
    dist.all_reduce(hist)
    net.train()
    return hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    dist.barrier()

    train_ds = ACDC(args.root, "train", args.crop, True)
    val_ds = ACDC(args.root, "val", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = smp.DeepLabV3Plus(encoder_name="resnet101", encoder_weights="imagenet", classes=N)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    optimizer = torch.optim.SGD([
        {"params": net.encoder.parameters(), "lr": args.lr},
        {"params": list(net.decoder.parameters()) + list(net.segmentation_head.parameters()), "lr": args.lr * 10},
    ], momentum=0.9, weight_decay=1e-4)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    start_it, best = 0, 0.0
    latest = os.path.join(args.work_dir, "latest.pth")
    if os.path.isfile(latest):
        ckpt = torch.load(latest)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_it, best = ckpt["iter"], ckpt["best"]
        if rank == 0:
            print(f"resumed from {latest} @ iter {start_it}", flush=True)
    model = DDP(net, device_ids=[local_rank])

    it = start_it
    epoch = it // len(loader)
    t0 = time.time()
    while it < args.max_iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            for g, b in zip(optimizer.param_groups, base_lrs):
                g["lr"] = b * (1 - it / args.max_iters) ** 0.9
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"it {it} loss {loss.item():.4f} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_every == 0 or it == args.max_iters:
                iou = slide_eval(net, val_loader, device)
                miou = torch.nanmean(iou).item()
                if rank == 0:
                    print(f"it {it} mIoU {100 * miou:.2f}", flush=True)
                    if miou > best:
                        torch.save({"model": net.state_dict(), "iter": it, "mIoU": miou},
                                   os.path.join(args.work_dir, "best.pth"))
                best = max(best, miou)
            if it % args.ckpt_every == 0 and rank == 0:
                tmp = latest + ".tmp"
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it, "best": best}, tmp)
                os.replace(tmp, latest)
            if it >= args.max_iters:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
