"""SimpleNet training (feature adaptor + discriminator on noised features).

Frozen WideResNet50 layer2/layer3 features -> linear adaptor -> MLP
discriminator that separates adapted nominal features from the same features
plus Gaussian noise. One run per product line, tracked in W&B.

    torchrun --nproc_per_node=4 simplenet.py --line sealing_ring_07 \
        --data /data/aoi --project aoi-simplenet --entity plant-vision
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


class RunLogger:
    """Thin wrapper so the training code does not depend on wandb directly."""

    def __init__(self, args, rank):
        self.rank = rank
        self.run = wandb.init(project=args.project, entity=args.entity, name=f"{args.line}-{args.tag}",
                              config=vars(args), group=args.line, job_type="train")

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def summary(self, **kw):
        for k, v in kw.items():
            self.run.summary[k] = v

    def finish(self):
        self.run.finish()


class LineSet(Dataset):
    def __init__(self, root, split, size, crop):
        self.items = []
        for d in sorted((root / split).iterdir()):
            for f in sorted(d.glob("*.png")):
                gt = root / "ground_truth" / d.name / f"{f.stem}_mask.png"
                self.items.append((f, gt if gt.exists() else None, int(d.name != "good")))
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(crop), transforms.ToTensor(), norm])
        self.mtf = transforms.Compose([transforms.Resize(size, transforms.InterpolationMode.NEAREST),
                                       transforms.CenterCrop(crop), transforms.ToTensor()])
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, gt, y = self.items[i]
        m = self.mtf(Image.open(gt).convert("L")) if gt else torch.zeros(1, self.crop, self.crop)
        return self.tf(Image.open(f).convert("RGB")), m, y


class FrozenFeatures(nn.Module):
    def __init__(self, dim=1536):
        super().__init__()
        w = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.l12 = nn.Sequential(w.conv1, w.bn1, w.relu, w.maxpool, w.layer1, w.layer2)
        self.l3 = w.layer3
        self.dim = dim
        self.requires_grad_(False)
        self.eval()

    def train(self, mode=True):
        return super().train(False)

    @torch.no_grad()
    def forward(self, x):
        f2 = self.l12(x)
        f3 = self.l3(f2)
        f3 = F.interpolate(f3, size=f2.shape[-2:], mode="bilinear", align_corners=False)
        f = torch.cat([F.avg_pool2d(f2, 3, 1, 1), F.avg_pool2d(f3, 3, 1, 1)], 1)
        b, c, h, w = f.shape
        f = F.adaptive_avg_pool1d(f.permute(0, 2, 3, 1).reshape(-1, 1, c), self.dim).reshape(b * h * w, self.dim)
        return f, (b, h, w)


class SimpleNetHead(nn.Module):
    def __init__(self, dim=1536, hidden=1024):
        super().__init__()
        self.adaptor = nn.Linear(dim, dim)
        self.discriminator = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
                                           nn.Linear(hidden, 1))

    def forward(self, feats, noise_std=None):
        z = self.adaptor(feats)
        if noise_std is None:
            return self.discriminator(z).squeeze(1)
        fake = z + torch.randn_like(z) * noise_std
        scores = self.discriminator(torch.cat([z, fake]))
        return scores.squeeze(1)


@torch.no_grad()
def evaluate(backbone, head, loader, crop, device):
    head.eval()
    labels, scores, px_y, px_s = [], [], [], []
    for x, m, y in loader:
        f, (b, h, w) = backbone(x.to(device))
        s = -head(f).reshape(b, 1, h, w)                       # higher = more anomalous
        s = F.interpolate(s, size=crop, mode="bilinear", align_corners=False)[:, 0].cpu().numpy()
        for k in range(b):
            a = gaussian_filter(s[k], sigma=4)
            labels.append(int(y[k]))
            scores.append(a.max())
            px_y.append(m[k, 0].numpy().ravel() > 0.5)
            px_s.append(a.ravel())
    head.train()
    return roc_auc_score(labels, scores), roc_auc_score(np.concatenate(px_y), np.concatenate(px_s))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--line", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/data/aoi/models/simplenet")
    ap.add_argument("--project", default="aoi-simplenet")
    ap.add_argument("--entity", default=None)
    ap.add_argument("--tag", default="v1")
    ap.add_argument("--size", type=int, default=329)
    ap.add_argument("--crop", type=int, default=288)
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--noise-std", type=float, default=0.015)
    ap.add_argument("--th", type=float, default=0.5)
    ap.add_argument("--lr-adaptor", type=float, default=1e-4)
    ap.add_argument("--lr-disc", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger = RunLogger(args, rank)

    root = Path(args.data) / args.line
    train_ds, test_ds = LineSet(root, "train", args.size, args.crop), LineSet(root, "test", args.size, args.crop)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=8, num_workers=4)

    backbone = FrozenFeatures().to(device)
    head = SimpleNetHead().to(device)
    head = nn.SyncBatchNorm.convert_sync_batchnorm(head)
    head = DDP(head, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([{"params": head.module.adaptor.parameters(), "lr": args.lr_adaptor},
                                   {"params": head.module.discriminator.parameters(), "lr": args.lr_disc}],
                                  weight_decay=1e-5)

    out_dir = Path(args.out) / args.line / args.tag
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(4, device=device)
        for x, _, _ in loader:
            f, _ = backbone(x.to(device, non_blocking=True))
            scores = head(f, noise_std=args.noise_std)
            true_s, fake_s = scores.chunk(2)
            loss_true = torch.clamp(args.th - true_s, min=0).mean()
            loss_fake = torch.clamp(args.th + fake_s, min=0).mean()
            loss = loss_true + loss_fake
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            acc += torch.stack([loss.detach(), (true_s > 0).float().mean(), (fake_s < 0).float().mean(),
                                torch.ones((), device=device)])
        dist.all_reduce(acc)
        loss_m, p_true, p_fake = (acc[:3] / acc[3]).tolist()
        logger.log({"train/loss": loss_m, "train/p_true": p_true, "train/p_fake": p_fake,
                    "epoch_time": time.time() - t0}, step=step)

        if rank == 0 and (epoch + 1) % 8 == 0:
            img_auc, px_auc = evaluate(backbone, head.module, test_loader, args.crop, device)
            logger.log({"test/image_auroc": img_auc, "test/pixel_auroc": px_auc}, step=step)
            print(f"[{args.line}] epoch {epoch + 1} loss {loss_m:.4f} img {img_auc:.4f} px {px_auc:.4f}", flush=True)
            if img_auc >= best:
                best = img_auc
                torch.save({"head": head.module.state_dict(), "epoch": epoch, "image_auroc": img_auc,
                            "args": vars(args)}, out_dir / "best.pt")
        dist.barrier()

    if rank == 0:
        logger.summary(best_image_auroc=best)
    logger.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
