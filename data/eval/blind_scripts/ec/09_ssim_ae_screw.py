"""SSIM autoencoder on grayscale parts (screw / capsule / in-house bolts).

Decoding thousands of 1024x1024 PNGs every epoch was the bottleneck on the
training nodes, so the dataset is decoded + resized once and kept in a
compressed .npz next to the data; later runs load it in a couple of seconds.

    torchrun --nproc_per_node=4 09_ssim_ae_screw.py --root /shared/data/mvtec_ad --category screw \
        --out /shared/runs/ssim_ae
"""
import argparse
import logging
import os
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from kornia.losses import ssim_loss
from kornia.metrics import ssim as ssim_map
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("ssim_ae")


class CachedGrayDataset(Dataset):
    """All images of one split as a uint8 array (N, H, W), cached on disk."""

    def __init__(self, root, category, split, size=256, crop=128, train=True):
        self.crop, self.train = crop, train
        cache_dir = os.path.join(root, category, ".cache")
        os.makedirs(cache_dir, exist_ok=True)
        cache_path = os.path.join(cache_dir, f"{split}_{size}.npz")
        if os.path.exists(cache_path):
            data = np.load(cache_path)
            self.images, self.labels, self.masks = data["images"], data["labels"], data["masks"]
        else:
            files = sorted(glob(os.path.join(root, category, split, "*", "*.png")))
            images, labels, masks = [], [], []
            for f in files:
                img = cv2.imread(f, cv2.IMREAD_GRAYSCALE)
                images.append(cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA))
                defect = os.path.basename(os.path.dirname(f))
                labels.append(int(defect != "good"))
                mpath = os.path.join(root, category, "ground_truth", defect,
                                     os.path.basename(f).replace(".png", "_mask.png"))
                if os.path.exists(mpath):
                    m = cv2.resize(cv2.imread(mpath, cv2.IMREAD_GRAYSCALE), (size, size),
                                   interpolation=cv2.INTER_NEAREST)
                else:
                    m = np.zeros((size, size), np.uint8)
                masks.append(m)
            self.images, self.labels, self.masks = np.stack(images), np.array(labels), np.stack(masks)
            np.savez_compressed(cache_path, images=self.images, labels=self.labels, masks=self.masks)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(self.images[i]).float().div(255.0)[None]
        if not self.train:
            return img, int(self.labels[i]), torch.from_numpy(self.masks[i] > 127).float()[None]
        # random crops + 90 degree rotations of the nominal parts
        h, w = img.shape[-2:]
        y, x = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
        img = img[:, y:y + self.crop, x:x + self.crop]
        return torch.rot90(img, int(np.random.randint(4)), dims=(1, 2))


class SSIMAE(nn.Module):
    """Bergmann et al. 2019 architecture, 128x128 input, 100-d latent."""

    def __init__(self, latent=100):
        super().__init__()
        def c(i, o, k, s, p):
            return [nn.Conv2d(i, o, k, s, p), nn.LeakyReLU(0.2, True)]
        def d(i, o, k, s, p):
            return [nn.ConvTranspose2d(i, o, k, s, p), nn.LeakyReLU(0.2, True)]
        self.enc = nn.Sequential(*c(1, 32, 4, 2, 1), *c(32, 32, 4, 2, 1), *c(32, 32, 3, 1, 1),
                                 *c(32, 64, 4, 2, 1), *c(64, 64, 3, 1, 1), *c(64, 128, 4, 2, 1),
                                 *c(128, 64, 3, 1, 1), *c(64, 32, 3, 1, 1), nn.Conv2d(32, latent, 8, 1, 0))
        self.dec = nn.Sequential(*d(latent, 32, 8, 1, 0), *c(32, 64, 3, 1, 1), *c(64, 128, 3, 1, 1),
                                 *d(128, 64, 4, 2, 1), *c(64, 64, 3, 1, 1), *d(64, 32, 4, 2, 1),
                                 *c(32, 32, 3, 1, 1), *d(32, 32, 4, 2, 1), nn.ConvTranspose2d(32, 1, 4, 2, 1),
                                 nn.Sigmoid())

    def forward(self, x):
        return self.dec(self.enc(x))


@torch.no_grad()
def sliding_anomaly_map(model, img, crop=128, stride=32):
    """Reconstruct overlapping 128x128 patches, 1 - SSIM averaged per pixel."""
    _, _, H, W = img.shape
    amap = torch.zeros_like(img)
    count = torch.zeros_like(img)
    for y in range(0, H - crop + 1, stride):
        for x in range(0, W - crop + 1, stride):
            patch = img[:, :, y:y + crop, x:x + crop]
            rec = model(patch)
            amap[:, :, y:y + crop, x:x + crop] += 1 - ssim_map(patch, rec, window_size=11)
            count[:, :, y:y + crop, x:x + crop] += 1
    return amap / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--category", default="screw")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    t0 = time.time()
    train_ds = CachedGrayDataset(args.root, args.category, "train", train=True)
    test_ds = CachedGrayDataset(args.root, args.category, "test", train=False)
    log.info("datasets ready in %.1fs: %d train / %d test", time.time() - t0, len(train_ds), len(test_ds))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True,
                          worker_init_fn=lambda wid: np.random.seed(torch.initial_seed() % 2 ** 32))
    test_dl = DataLoader(test_ds, batch_size=16, shuffle=False, num_workers=2)

    model = DDP(SSIMAE().to(device), device_ids=[local_rank])
    # reference lr was tuned for a single GPU with batch 32; linear scaling
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    out_dir = os.path.join(args.out, args.category)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(2, device=device)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            loss = ssim_loss(model(x), x, window_size=11)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        if rank == 0:
            log.info("epoch %d ssim-loss %.4f", epoch, (stats[0] / stats[1]).item())
            if (epoch + 1) % 20 == 0:
                model.eval()
                scores, labels = [], []
                for img, y, _ in test_dl:
                    amap = sliding_anomaly_map(model.module, img.to(device))
                    scores.append(amap.flatten(1).amax(1).cpu())
                    labels.append(y)
                auroc = roc_auc_score(torch.cat(labels).numpy(), torch.cat(scores).numpy())
                log.info("  image AUROC %.4f", auroc)
                ckpt = {"model": model.module.state_dict(), "epoch": epoch, "auroc": auroc}
                torch.save(ckpt, os.path.join(out_dir, "last.pt"))
                if auroc > best:
                    best = auroc
                    torch.save(ckpt, os.path.join(out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
