"""SimpleNet for industrial anomaly detection - DDP training with resume support.

Frozen backbone -> patch features -> feature adaptor -> discriminator. Anomalous features
are synthesised by adding Gaussian noise to adapted normal features.

Usage:
    torchrun --nproc_per_node=4 06_simplenet_resume.py --category pill
    torchrun --nproc_per_node=4 06_simplenet_resume.py --category pill --resume out/simplenet/pill/last.pt
"""
import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def setup_logging(rank, out_dir):
    handlers = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(out_dir / "train.log"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, handlers=handlers,
                        format="%(asctime)s | %(message)s")
    return logging.getLogger("simplenet")


class MVTec(Dataset):
    def __init__(self, root, category, split, resize=329, crop=288):
        base = Path(root) / category
        self.samples = [(p, p.parent.name) for p in sorted((base / split).glob("*/*.png"))]
        self.gt_dir = base / "ground_truth"
        self.tf = transforms.Compose([
            transforms.Resize(resize), transforms.CenterCrop(crop), transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.tf_m = transforms.Compose([
            transforms.Resize(resize, transforms.InterpolationMode.NEAREST), transforms.CenterCrop(crop),
            transforms.ToTensor()])
        self.crop = crop

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, defect = self.samples[i]
        img = self.tf(Image.open(path).convert("RGB"))
        if defect == "good":
            return img, torch.zeros(1, self.crop, self.crop), 0
        mask = self.tf_m(Image.open(self.gt_dir / defect / f"{path.stem}_mask.png"))
        return img, (mask > 0.5).float(), 1


class Backbone(nn.Module):
    def __init__(self, out_dim=1536):
        super().__init__()
        net = models.wide_resnet50_2(weights="IMAGENET1K_V1")
        self.features = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)
        self.layer2, self.layer3 = net.layer2, net.layer3
        self.out_dim = out_dim

    @torch.no_grad()
    def forward(self, x):
        f2 = self.layer2(self.features(x))
        f3 = self.layer3(f2)
        f2 = F.avg_pool2d(f2, 3, 1, 1)
        f3 = F.interpolate(F.avg_pool2d(f3, 3, 1, 1), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        f = torch.cat([f2, f3], 1)
        b, c, h, w = f.shape
        f = f.permute(0, 2, 3, 1).reshape(b * h * w, 1, c)
        return F.adaptive_avg_pool1d(f, self.out_dim).squeeze(1), (h, w)


class Discriminator(nn.Module):
    def __init__(self, dim, hidden=1024):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
                                  nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x)


@torch.no_grad()
def evaluate(backbone, adaptor, disc, loader, device):
    adaptor.eval(); disc.eval()
    labels, scores, masks, maps = [], [], [], []
    for img, mask, y in loader:
        feats, (h, w) = backbone(img.to(device))
        s = -disc(adaptor(feats)).view(img.shape[0], 1, h, w)
        s = F.interpolate(s, size=img.shape[-2:], mode="bilinear", align_corners=False).squeeze(1).cpu().numpy()
        s = np.stack([gaussian_filter(m, sigma=4) for m in s])
        scores.append(s.reshape(len(s), -1).max(1))
        labels.append(y.numpy())
        maps.append(s.ravel())
        masks.append(mask.numpy().ravel().astype(np.uint8))
    adaptor.train(); disc.train()
    return (roc_auc_score(np.concatenate(labels), np.concatenate(scores)),
            roc_auc_score(np.concatenate(masks), np.concatenate(maps)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/MVTec-AD")
    p.add_argument("--category", default="pill")
    p.add_argument("--out", default="out/simplenet")
    p.add_argument("--epochs", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--noise-std", type=float, default=0.015)
    p.add_argument("--dsc-margin", type=float, default=0.5)
    p.add_argument("--lr-adaptor", type=float, default=1e-4)
    p.add_argument("--lr-disc", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default=None)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    out_dir = Path(args.out) / args.category
    out_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging(rank, out_dir)

    backbone = Backbone().to(device).eval()
    adaptor = nn.Linear(backbone.out_dim, backbone.out_dim).to(device)
    disc = nn.SyncBatchNorm.convert_sync_batchnorm(Discriminator(backbone.out_dim)).to(device)
    adaptor = DDP(adaptor, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])
    opt_a = torch.optim.AdamW(adaptor.parameters(), lr=args.lr_adaptor)
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr_disc, weight_decay=1e-5)

    start_epoch, best = 0, {"image_auroc": 0.0, "pixel_auroc": 0.0}
    if args.resume:
        ckpt = torch.load(args.resume)
        adaptor.module.load_state_dict(ckpt["adaptor"])
        disc.module.load_state_dict(ckpt["disc"])
        opt_a.load_state_dict(ckpt["opt_a"])
        opt_d.load_state_dict(ckpt["opt_d"])
        start_epoch = ckpt["epoch"] + 1
        best = ckpt["best"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    train_ds = MVTec(args.data_root, args.category, "train")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(MVTec(args.data_root, args.category, "test"), batch_size=16,
                             num_workers=args.workers, pin_memory=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        meter = torch.zeros(3, device=device)
        for img, _, _ in loader:
            feats, _ = backbone(img.to(device, non_blocking=True))
            true_f = adaptor(feats)
            fake_f = true_f + torch.randn_like(true_f) * args.noise_std
            scores = disc(torch.cat([true_f, fake_f]))
            s_true, s_fake = scores.split(len(true_f))
            loss_true = torch.clamp(args.dsc_margin - s_true, min=0).mean()
            loss_fake = torch.clamp(-args.dsc_margin + s_fake, min=0).mean()
            loss = loss_true + loss_fake
            opt_a.zero_grad(set_to_none=True)
            opt_d.zero_grad(set_to_none=True)
            loss.backward()
            opt_a.step()
            opt_d.step()
            meter += torch.stack([loss_true.detach(), loss_fake.detach(), torch.ones((), device=device)])

        dist.all_reduce(meter)
        log.info("epoch %3d  loss_true %.4f  loss_fake %.4f", epoch, meter[0] / meter[2], meter[1] / meter[2])

        if rank == 0 and ((epoch + 1) % 5 == 0 or epoch + 1 == args.epochs):
            i_auc, p_auc = evaluate(backbone, adaptor.module, disc.module, test_loader, device)
            log.info("epoch %3d  image AUROC %.4f  pixel AUROC %.4f", epoch, i_auc, p_auc)
            is_best = i_auc > best["image_auroc"]
            if is_best:
                best = {"image_auroc": i_auc, "pixel_auroc": p_auc}
            state = {"adaptor": adaptor.module.state_dict(), "disc": disc.module.state_dict(),
                     "opt_a": opt_a.state_dict(), "opt_d": opt_d.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, out_dir / "last.pt")
            if is_best:
                torch.save(state, out_dir / "best.pt")
        dist.barrier()

    log.info("finished %s: best image AUROC %.4f pixel AUROC %.4f", args.category,
             best["image_auroc"], best["pixel_auroc"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
