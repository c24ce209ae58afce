"""Reverse distillation (RD4AD) for the bearing-ring inspection cell.

Frozen WideResNet50 encoder -> trainable one-class bottleneck (OCBE) ->
trainable reverse decoder. Anomaly map = sum over scales of 1 - cos(enc, dec).

    torchrun --nproc_per_node=4 rd4ad.py --config configs/bearing_ring.yaml
"""
import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.models.resnet import Bottleneck

logger = logging.getLogger(__name__)


class RingDataset(Dataset):
    def __init__(self, root, split, size):
        root = Path(root)
        self.items = []
        for d in sorted((root / split).iterdir()):
            for f in sorted(d.glob("*.png")):
                gt = root / "ground_truth" / d.name / f"{f.stem}_mask.png"
                self.items.append((f, gt if gt.exists() else None, int(d.name != "good")))
        self.img_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                          transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, gt, y = self.items[i]
        x = self.img_tf(Image.open(f).convert("RGB"))
        m = np.zeros((self.size, self.size), np.uint8)
        if gt is not None:
            m = np.array(Image.open(gt).convert("L").resize((self.size, self.size), Image.NEAREST)) > 127
        return x, torch.from_numpy(m.astype(np.uint8)), y


def deconv_layer(inplanes, planes, blocks, stride):
    """Upsampling stage of the reverse decoder: transposed conv + bottleneck blocks."""
    layers = [nn.Sequential(nn.ConvTranspose2d(inplanes, planes * 4, 2, stride=stride),
                            nn.BatchNorm2d(planes * 4), nn.ReLU(inplace=True))]
    layers += [Bottleneck(planes * 4, planes) for _ in range(blocks)]
    return nn.Sequential(*layers)


class OCBE(nn.Module):
    """Fuses the three encoder scales into one compact embedding."""

    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(256, 512, 3, 2, 1), nn.BatchNorm2d(512), nn.ReLU(inplace=True),
                                   nn.Conv2d(512, 1024, 3, 2, 1), nn.BatchNorm2d(1024), nn.ReLU(inplace=True))
        self.down2 = nn.Sequential(nn.Conv2d(512, 1024, 3, 2, 1), nn.BatchNorm2d(1024), nn.ReLU(inplace=True))
        self.fuse = nn.Sequential(nn.Conv2d(3072, 2048, 3, 2, 1), nn.BatchNorm2d(2048), nn.ReLU(inplace=True),
                                  Bottleneck(2048, 512))

    def forward(self, feats):
        f1, f2, f3 = feats
        return self.fuse(torch.cat([self.down1(f1), self.down2(f2), f3], 1))


class RD4AD(nn.Module):
    def __init__(self):
        super().__init__()
        enc = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.encoder = nn.ModuleDict({"stem": nn.Sequential(enc.conv1, enc.bn1, enc.relu, enc.maxpool),
                                      "l1": enc.layer1, "l2": enc.layer2, "l3": enc.layer3})
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        self.bottleneck = OCBE()
        self.dec3 = deconv_layer(2048, 256, 2, 2)   # -> 1024 ch
        self.dec2 = deconv_layer(1024, 128, 2, 2)   # -> 512 ch
        self.dec1 = deconv_layer(512, 64, 2, 2)     # -> 256 ch

    def train(self, mode=True):
        super().train(mode)
        self.encoder.eval()  # frozen BN statistics
        return self

    def encode(self, x):
        with torch.no_grad():
            x = self.encoder["stem"](x)
            f1 = self.encoder["l1"](x)
            f2 = self.encoder["l2"](f1)
            f3 = self.encoder["l3"](f2)
        return [f1, f2, f3]

    def forward(self, x):
        enc = self.encode(x)
        z = self.bottleneck(enc)
        d3 = self.dec3(z)
        d2 = self.dec2(d3)
        d1 = self.dec1(d2)
        return enc, [d1, d2, d3]

    @torch.no_grad()
    def anomaly_map(self, x, out_size):
        enc, dec = self.forward(x)
        amap = torch.zeros(x.shape[0], 1, out_size, out_size, device=x.device)
        for e, d in zip(enc, dec):
            a = 1 - F.cosine_similarity(e, d, dim=1).unsqueeze(1)
            amap += F.interpolate(a, size=out_size, mode="bilinear", align_corners=True)
        return amap[:, 0]


def cosine_loss(enc, dec):
    return sum(torch.mean(1 - F.cosine_similarity(e.flatten(1), d.flatten(1), dim=1)) for e, d in zip(enc, dec))


@torch.no_grad()
def evaluate(model, loader, size, device):
    model.eval()
    labels, scores, px_gt, px_pred = [], [], [], []
    for x, m, y in loader:
        amap = model.anomaly_map(x.to(device), size).cpu().numpy()
        for k in range(len(y)):
            a = gaussian_filter(amap[k], sigma=4)
            scores.append(a.max())
            labels.append(int(y[k]))
            px_gt.append(m[k].numpy().ravel())
            px_pred.append(a.ravel())
    model.train()
    return roc_auc_score(labels, scores), roc_auc_score(np.concatenate(px_gt), np.concatenate(px_pred))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(parser.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.get("seed", 111))

    size = cfg["image_size"]
    train_ds = RingDataset(cfg["data_root"], "train", size)
    test_ds = RingDataset(cfg["data_root"], "test", size)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"] // world, sampler=sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=1, num_workers=4)

    model = RD4AD()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = list(model.module.bottleneck.parameters()) + list(model.module.dec1.parameters()) + \
        list(model.module.dec2.parameters()) + list(model.module.dec3.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.get("lr", 0.005), betas=(0.5, 0.999))

    out = Path(cfg["output_dir"])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, _, _ in train_loader:
            x = x.to(device, non_blocking=True)
            enc, dec = model(x)
            loss = cosine_loss(enc, dec)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        logger.info("epoch %d loss %.4f (%.0fs)", epoch, (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % cfg.get("eval_every", 10) == 0 and rank == 0:
            img_auc, px_auc = evaluate(model, test_loader, size, device)
            logger.info("epoch %d image AUROC %.4f pixel AUROC %.4f", epoch, img_auc, px_auc)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "img_auc": img_auc}, out / "last.pth")
            if img_auc > best:
                best = img_auc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "img_auc": img_auc}, out / "best.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
