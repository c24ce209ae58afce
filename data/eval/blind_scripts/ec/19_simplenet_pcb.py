"""SimpleNet for PCB solder-joint inspection.

Frozen WRN50 layer2+3 patch features -> trainable feature adaptor -> MLP
discriminator. Anomalous features are synthesised by adding Gaussian noise to
adapted nominal features. Scoring is distributed over all GPUs.

    torchrun --nproc_per_node=4 19_simplenet_pcb.py --root /data/pcb_solder --out /shared/pcb/simplenet
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import wide_resnet50_2, Wide_ResNet50_2_Weights


class SolderDataset(Dataset):
    def __init__(self, root, split, size=288):
        base = os.path.join(root, split)
        self.items = [(os.path.join(base, c, f), int(c != "good"))
                      for c in sorted(os.listdir(base)) for f in sorted(os.listdir(os.path.join(base, c)))]
        self.tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), y, i


class FrozenWRN(nn.Module):
    def __init__(self):
        super().__init__()
        net = wide_resnet50_2(weights=Wide_ResNet50_2_Weights.IMAGENET1K_V1).eval()
        self.body = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)
        self.layer2, self.layer3 = net.layer2, net.layer3
        self.requires_grad_(False)
        self.pool = nn.AvgPool2d(3, 1, 1)

    @torch.no_grad()
    def forward(self, x):
        f2 = self.layer2(self.body(x))
        f3 = self.layer3(f2)
        f3 = F.interpolate(self.pool(f3), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        f = torch.cat([self.pool(f2), f3], 1)  # B x 1536 x H x W
        # channel pooling to 1536 -> 768 like the reference implementation
        return F.adaptive_avg_pool1d(f.permute(0, 2, 3, 1).flatten(0, 2)[:, None], 768)[:, 0], f.shape


class AdaptorDiscriminator(nn.Module):
    def __init__(self, dim=768, hidden=1024):
        super().__init__()
        self.adaptor = nn.Linear(dim, dim)
        self.disc = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
                                  nn.Linear(hidden, 1))

    def forward(self, feats, noise_std=None):
        a = self.adaptor(feats)
        if noise_std is None:
            return self.disc(a).squeeze(1)
        fake = a + torch.randn_like(a) * noise_std
        return self.disc(torch.cat([a, fake])).squeeze(1)


def gaussian_kernel(sigma=4, device="cuda:0"):
    r = int(4 * sigma + 0.5)
    x = torch.arange(-r, r + 1, dtype=torch.float32, device=device)
    k = torch.exp(-x ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    return (k[:, None] * k[None, :])[None, None], r


def smooth(maps, sigma=4):
    k, r = gaussian_kernel(sigma)
    return F.conv2d(F.pad(maps, (r, r, r, r), mode="reflect"), k)


@torch.no_grad()
def score_shard(backbone, head, loader, device, size):
    head.eval()
    out = []
    for x, y, idx in loader:
        feats, (b, c, h, w) = backbone(x.to(device, non_blocking=True))
        s = -head(feats).reshape(b, 1, h, w)
        amap = smooth(F.interpolate(s, size=(size, size), mode="bilinear", align_corners=False))
        img_score = amap.flatten(1).amax(1)
        out.append(torch.stack([idx.to(device).float(), y.to(device).float(), img_score], 1))
    head.train()
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=288)
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=32, help="images per step, all GPUs together")
    ap.add_argument("--lr-adaptor", type=float, default=1e-4)
    ap.add_argument("--lr-disc", type=float, default=2e-4)
    ap.add_argument("--noise-std", type=float, default=0.015)
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = SolderDataset(args.root, "train", args.size)
    test_ds = SolderDataset(args.root, "test", args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=8, sampler=DistributedSampler(test_ds, shuffle=False),
                         num_workers=6, pin_memory=True)

    backbone = FrozenWRN().to(device)
    head = nn.SyncBatchNorm.convert_sync_batchnorm(AdaptorDiscriminator()).to(device)
    head = DDP(head, device_ids=[local_rank])
    opt = torch.optim.Adam([{"params": head.module.adaptor.parameters(), "lr": args.lr_adaptor},
                            {"params": head.module.disc.parameters(), "lr": args.lr_disc, "weight_decay": 1e-5}])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=args.lr_adaptor * 0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        head.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, _, _ in train_dl:
            feats, _ = backbone(x.to(device, non_blocking=True))
            scores = head(feats, noise_std=args.noise_std)
            n = feats.shape[0]
            true_s, fake_s = scores[:n], scores[n:]
            loss = F.relu(args.margin - true_s).mean() + F.relu(args.margin + fake_s).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), ((true_s > 0).float().mean() + (fake_s < 0).float().mean()) / 2,
                                  torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        msg = f"epoch {epoch:3d} loss {(stats[0] / stats[2]).item():.4f} acc {(stats[1] / stats[2]).item():.3f}"
        if (epoch + 1) % args.eval_every == 0:
            local = score_shard(backbone, head.module, test_dl, device, args.size)
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local)
            allr = torch.cat(parts).cpu().numpy()
            _, first = np.unique(allr[:, 0], return_index=True)
            allr = allr[first]
            auroc = roc_auc_score(allr[:, 1], allr[:, 2])
            msg += f" | image AUROC {auroc:.4f}"
            if rank == 0 and auroc > best:
                best = auroc
                torch.save({"head": head.module.state_dict(), "epoch": epoch, "auroc": auroc},
                           os.path.join(args.out, "simplenet_best.pth"))
        if rank == 0:
            print(msg + f" ({time.time() - t0:.0f}s)", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
