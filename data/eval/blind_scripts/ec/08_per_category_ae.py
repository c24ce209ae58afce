"""Per-category autoencoder baseline on MVTec AD (and our in-house parts).

One model per category, trained one after another inside the same job so
that the queue slot is held once. For every category a fresh model, DDP
wrapper, optimizer and loaders are built; rank 0 evaluates image AUROC,
pixel AUROC and PRO on the full test split and writes the checkpoint.

    torchrun --nnodes=1 --nproc_per_node=4 08_per_category_ae.py \
        --root /nfs/datasets/mvtec_ad --out /nfs/exp/ae_baseline --categories all
"""
import argparse
import csv
import gc
import math
import os
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from skimage.measure import label as cc_label, regionprops
from sklearn.metrics import auc, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms.functional as TF

ALL = ["bottle", "cable", "capsule", "carpet", "grid", "hazelnut", "leather", "metal_nut",
       "pill", "screw", "tile", "toothbrush", "transistor", "wood", "zipper"]


class MVTecCat(Dataset):
    def __init__(self, root, cat, split, size):
        self.files = sorted(glob(os.path.join(root, cat, split, "*", "*.png")))
        self.root, self.cat, self.size, self.split = root, cat, size, split

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        img = TF.to_tensor(TF.resize(Image.open(f).convert("RGB"), [self.size, self.size]))
        if self.split == "train":
            if torch.rand(1) < 0.5:
                img = TF.hflip(img)
            return img
        defect = os.path.basename(os.path.dirname(f))
        if defect == "good":
            mask = torch.zeros(1, self.size, self.size)
        else:
            mp = os.path.join(self.root, self.cat, "ground_truth", defect, os.path.basename(f)[:-4] + "_mask.png")
            mask = TF.to_tensor(TF.resize(Image.open(mp), [self.size, self.size],
                                          interpolation=TF.InterpolationMode.NEAREST))
        return img, int(defect != "good"), mask


class ConvAE(nn.Module):
    def __init__(self, z=128):
        super().__init__()
        def enc(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 4, 2, 1), nn.BatchNorm2d(o), nn.LeakyReLU(0.2, True))
        def dec(i, o):
            return nn.Sequential(nn.ConvTranspose2d(i, o, 4, 2, 1), nn.BatchNorm2d(o), nn.ReLU(True))
        self.encoder = nn.Sequential(enc(3, 32), enc(32, 64), enc(64, 128), enc(128, 256), nn.Conv2d(256, z, 8))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(z, 256, 8), nn.BatchNorm2d(256), nn.ReLU(True),
                                     dec(256, 128), dec(128, 64), dec(64, 32),
                                     nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x))


def compute_pro(masks, amaps, fpr_limit=0.3, num_th=100):
    regions = [(i, r.coords) for i, m in enumerate(masks) for r in regionprops(cc_label(m))]
    neg = masks == 0
    fprs, pros = [], []
    for th in np.linspace(amaps.max(), amaps.min(), num_th):
        pred = amaps >= th
        fprs.append((pred & neg).sum() / max(neg.sum(), 1))
        pros.append(np.mean([pred[i][c[:, 0], c[:, 1]].mean() for i, c in regions]) if regions else 0.0)
    fprs, pros = np.array(fprs), np.array(pros)
    sel = fprs <= fpr_limit
    if sel.sum() < 2:
        return 0.0
    return auc(fprs[sel], pros[sel]) / fpr_limit


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    maps, labels, masks = [], [], []
    for img, y, m in loader:
        img = img.to(device)
        err = ((net(img) - img) ** 2).mean(1).cpu().numpy()
        maps.extend(gaussian_filter(e, sigma=4) for e in err)
        labels.extend(y.tolist())
        masks.append(m[:, 0].numpy() > 0.5)
    maps, masks = np.stack(maps), np.concatenate(masks)
    img_auc = roc_auc_score(labels, maps.reshape(len(maps), -1).max(1))
    px_auc = roc_auc_score(masks.ravel(), maps.ravel())
    return img_auc, px_auc, compute_pro(masks.astype(np.uint8), maps)


def train_category(cat, args, rank, world, device):
    train_ds = MVTecCat(args.root, cat, "train", args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    per_gpu = args.batch_size // world
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(ConvAE(args.z)).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    total = max(1, args.epochs * len(loader))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for x in loader:
            x = x.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach() * x.shape[0], torch.tensor(float(x.shape[0]), device=device)])
        dist.all_reduce(acc)
        if rank == 0 and (epoch % 20 == 0 or epoch == args.epochs - 1):
            print(f"  [{cat}] epoch {epoch:3d} mse {(acc[0] / acc[1]).item():.5f}", flush=True)

    result = None
    if rank == 0:
        test_ds = MVTecCat(args.root, cat, "test", args.size)
        test_dl = DataLoader(test_ds, batch_size=32, num_workers=args.workers)
        result = evaluate(model.module, test_dl, device)
        os.makedirs(os.path.join(args.out, cat), exist_ok=True)
        torch.save({"model": model.module.state_dict(), "category": cat, "size": args.size, "z": args.z},
                   os.path.join(args.out, cat, "ae.pt"))
    dist.barrier()

    del model, net, opt, sched, loader
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--categories", nargs="+", default=["all"])
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--z", type=int, default=128)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split across GPUs")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cats = ALL if args.categories == ["all"] else args.categories

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.batch_size % world == 0
    device = torch.device("cuda", local_rank)

    rows = []
    for cat in cats:
        t0 = time.time()
        res = train_category(cat, args, rank, world, device)
        if rank == 0:
            img_auc, px_auc, pro = res
            rows.append([cat, f"{img_auc:.4f}", f"{px_auc:.4f}", f"{pro:.4f}"])
            print(f"{cat}: image AUROC {img_auc:.4f} | pixel AUROC {px_auc:.4f} | PRO {pro:.4f} "
                  f"| {time.time() - t0:.0f}s", flush=True)

    if rank == 0:
        with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["category", "image_auroc", "pixel_auroc", "pro"])
            w.writerows(rows)
            w.writerow(["mean"] + [f"{np.mean([float(r[i]) for r in rows]):.4f}" for i in (1, 2, 3)])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
