"""DRAEM-style training with synthetic anomalies, plus a defect-type head.

Reconstructive sub-network learns to remove simulated defects, the
discriminative sub-network segments them from (input, reconstruction).
We additionally train a small head that predicts which synthetic defect
family was pasted (texture / scratch / blob); it is switched on after a
warm-up so the segmentation has converged a bit first.

    torchrun --nproc_per_node=4 04_draem_seg_train.py --category carpet \
        --mvtec /data/mvtec_ad --dtd /data/dtd/images --out /shared/draem
"""
import argparse
import glob
import logging
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from kornia.losses import FocalLoss, SSIMLoss

logger = logging.getLogger(__name__)
N_FAMILIES = 3  # 0 texture patch, 1 scratch, 2 blob


class SyntheticAnomalyDataset(Dataset):
    def __init__(self, image_dir, dtd_dir, size=256):
        self.images = sorted(glob.glob(os.path.join(image_dir, "*.png")))
        self.textures = sorted(glob.glob(os.path.join(dtd_dir, "*", "*.jpg")))
        self.size = size

    def __len__(self):
        return len(self.images)

    def _load(self, path):
        img = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
        return cv2.resize(img, (self.size, self.size)).astype(np.float32) / 255.0

    def _random_mask(self, family):
        s = self.size
        mask = np.zeros((s, s), np.float32)
        if family == 0:
            w, h = random.randint(s // 8, s // 3), random.randint(s // 8, s // 3)
            x, y = random.randint(0, s - w), random.randint(0, s - h)
            mask[y:y + h, x:x + w] = 1.0
        elif family == 1:
            p1 = (random.randint(0, s), random.randint(0, s))
            p2 = (random.randint(0, s), random.randint(0, s))
            cv2.line(mask, p1, p2, 1.0, thickness=random.randint(2, 6))
        else:
            c = (random.randint(s // 6, 5 * s // 6), random.randint(s // 6, 5 * s // 6))
            cv2.ellipse(mask, c, (random.randint(8, s // 6), random.randint(8, s // 6)),
                        random.randint(0, 180), 0, 360, 1.0, -1)
        return mask

    def __getitem__(self, idx):
        img = self._load(self.images[idx])
        if random.random() < 0.5:
            aug, mask, has_anom, family = img.copy(), np.zeros(img.shape[:2], np.float32), 0.0, -1
        else:
            family = random.randrange(N_FAMILIES)
            tex = self._load(random.choice(self.textures))
            mask = self._random_mask(family)
            beta = random.uniform(0.1, 0.8)
            m = mask[..., None]
            aug = img * (1 - m) + (1 - beta) * tex * m + beta * img * m
            has_anom = 1.0
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return {"image": to_t(img), "augmented": to_t(aug.astype(np.float32)),
                "mask": torch.from_numpy(mask)[None], "has_anomaly": torch.tensor(has_anom),
                "family": torch.tensor(family)}


def double_conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True))


class UNet(nn.Module):
    def __init__(self, cin, cout, base=64, final_act=None):
        super().__init__()
        self.d1, self.d2, self.d3 = double_conv(cin, base), double_conv(base, base * 2), double_conv(base * 2, base * 4)
        self.mid = double_conv(base * 4, base * 8)
        self.u3, self.u2, self.u1 = double_conv(base * 12, base * 4), double_conv(base * 6, base * 2), double_conv(base * 3, base)
        self.out = nn.Conv2d(base, cout, 1)
        self.final_act = final_act

    def forward(self, x, return_bottleneck=False):
        x1 = self.d1(x)
        x2 = self.d2(F.max_pool2d(x1, 2))
        x3 = self.d3(F.max_pool2d(x2, 2))
        m = self.mid(F.max_pool2d(x3, 2))
        up = lambda t, ref: F.interpolate(t, size=ref.shape[-2:], mode="bilinear", align_corners=False)
        y = self.u3(torch.cat([up(m, x3), x3], 1))
        y = self.u2(torch.cat([up(y, x2), x2], 1))
        y = self.u1(torch.cat([up(y, x1), x1], 1))
        y = self.out(y)
        if self.final_act is not None:
            y = self.final_act(y)
        return (y, m) if return_bottleneck else y


class DraemModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.reconstructive = UNet(3, 3, base=64, final_act=torch.sigmoid)
        self.discriminative = UNet(6, 2, base=32)
        self.family_head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 128),
                                         nn.ReLU(True), nn.Linear(128, N_FAMILIES))

    def forward(self, x, with_family=False):
        rec = self.reconstructive(x)
        seg, bottleneck = self.discriminative(torch.cat([rec, x], dim=1), return_bottleneck=True)
        if with_family:
            return rec, seg, self.family_head(bottleneck)
        return rec, seg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--category", required=True)
    ap.add_argument("--mvtec", required=True)
    ap.add_argument("--dtd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=700)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--family-start", type=int, default=100, help="epoch at which the family head joins")
    ap.add_argument("--family-weight", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)

    ds = SyntheticAnomalyDataset(os.path.join(args.mvtec, args.category, "train", "good"), args.dtd)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        worker_init_fn=lambda w: np.random.seed(rank * 1000 + w))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DraemModel()).to(device)
    model = DDP(model, device_ids=[local_rank])

    # DRAEM reference: lr 1e-4 at batch 8, scale linearly with the global batch
    lr = args.lr * world
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * 0.8), int(args.epochs * 0.9)], gamma=0.2)
    l2, ssim_loss, focal = nn.MSELoss(), SSIMLoss(window_size=11), FocalLoss(alpha=0.25, gamma=2.0, reduction="mean")

    out_dir = os.path.join(args.out, args.category)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_family = epoch >= args.family_start
        meter = torch.zeros(4, device=device)
        for batch in loader:
            img = batch["image"].to(device, non_blocking=True)
            aug = batch["augmented"].to(device, non_blocking=True)
            mask = batch["mask"].to(device, non_blocking=True)
            family = batch["family"].to(device, non_blocking=True)

            outputs = model(aug, with_family=use_family)
            rec, seg = outputs[0], outputs[1]
            loss_rec = l2(rec, img) + ssim_loss(rec, img)
            loss_seg = focal(seg, mask.squeeze(1).long())
            loss = loss_rec + loss_seg
            if use_family:
                n_valid = (family >= 0).sum().clamp(min=1)
                loss_fam = F.cross_entropy(outputs[2], family, ignore_index=-1, reduction="sum") / n_valid
                loss = loss + args.family_weight * loss_fam

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.stack([loss.detach(), loss_rec.detach(), loss_seg.detach(), torch.ones((), device=device)])
        sched.step()

        dist.all_reduce(meter)
        if rank == 0:
            n = meter[3].item()
            logger.info("epoch %d  loss %.4f  rec %.4f  seg %.4f", epoch, meter[0].item() / n,
                        meter[1].item() / n, meter[2].item() / n)
            if (epoch + 1) % 50 == 0 or epoch + 1 == args.epochs:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(out_dir, "draem_last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
