"""MemAE: memory-augmented autoencoder for unsupervised defect detection (MVTec AD / VisA).

The latent code is replaced by a sparse combination of learned memory items, so defects
cannot be reconstructed well. Trained with DDP, one category per run.

    torchrun --nnodes=1 --nproc_per_node=4 14_memae_train.py --cfg configs/memae.yaml --category tile
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
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

logger = logging.getLogger("memae")

DEFAULT_CFG = dict(
    data_root="/data/anomaly/mvtec_ad",
    image_size=256,
    grayscale=False,
    mem_dim=2000,
    shrink_thres=0.0025,
    entropy_weight=0.0002,
    batch_size=16,
    epochs=400,
    lr=1e-4,
    workers=8,
    eval_every=25,
    work_dir="work_dirs/memae",
)


class AnomalyFolder(Dataset):
    def __init__(self, root, category, split, size, grayscale=False):
        self.root = Path(root) / category
        self.files = sorted((self.root / split).glob("*/*.png"))
        ch = [T.Grayscale()] if grayscale else []
        aug = [T.RandomRotation(5), T.RandomHorizontalFlip()] if split == "train" else []
        self.tf = T.Compose(ch + [T.Resize((size, size))] + aug + [T.ToTensor()])
        self.mtf = T.Compose([T.Resize((size, size), T.InterpolationMode.NEAREST), T.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        f = self.files[idx]
        x = self.tf(Image.open(f).convert("RGB"))
        if f.parent.name == "good":
            return x, torch.zeros(1, self.size, self.size), 0
        gt = self.root / "ground_truth" / f.parent.name / f"{f.stem}_mask.png"
        return x, (self.mtf(Image.open(gt)) > 0.5).float(), 1


class MemoryUnit(nn.Module):
    def __init__(self, mem_dim, fea_dim, shrink_thres):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(mem_dim, fea_dim))
        nn.init.uniform_(self.weight, -1.0 / fea_dim ** 0.5, 1.0 / fea_dim ** 0.5)
        self.shrink_thres = shrink_thres

    def forward(self, z):  # z: N, C
        att = F.softmax(z @ self.weight.t(), dim=1)
        if self.shrink_thres > 0:
            att = F.relu(att - self.shrink_thres) * att / (torch.abs(att - self.shrink_thres) + 1e-12)
            att = F.normalize(att, p=1, dim=1)
        return att @ self.weight, att


class MemAE(nn.Module):
    def __init__(self, in_ch=3, mem_dim=2000, shrink_thres=0.0025):
        super().__init__()
        def down(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, 2, 1), nn.BatchNorm2d(o), nn.LeakyReLU(0.2, True))

        def up(i, o):
            return nn.Sequential(nn.ConvTranspose2d(i, o, 3, 2, 1, output_padding=1), nn.BatchNorm2d(o),
                                 nn.LeakyReLU(0.2, True))
        self.encoder = nn.Sequential(down(in_ch, 32), down(32, 64), down(64, 128), down(128, 256), down(256, 256))
        self.memory = MemoryUnit(mem_dim, 256, shrink_thres)
        self.decoder = nn.Sequential(up(256, 256), up(256, 128), up(128, 64), up(64, 32),
                                     nn.ConvTranspose2d(32, in_ch, 3, 2, 1, output_padding=1), nn.Sigmoid())

    def forward(self, x):
        z = self.encoder(x)
        b, c, h, w = z.shape
        zq, att = self.memory(z.permute(0, 2, 3, 1).reshape(-1, c))
        zq = zq.view(b, h, w, c).permute(0, 3, 1, 2)
        return self.decoder(zq), att


def entropy_loss(att):
    return (-att * torch.log(att + 1e-12)).sum(dim=1).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s_img, y_img, s_pix, y_pix = [], [], [], []
    for x, m, y in loader:
        x = x.to(device, non_blocking=True)
        rec, _ = model(x)
        err = F.avg_pool2d(((x - rec) ** 2).mean(1, keepdim=True), 9, 1, 4)
        s_img.append(err.flatten(1).mean(1).cpu())
        y_img.append(y)
        s_pix.append(err[:, :, ::2, ::2].flatten().cpu())
        y_pix.append(m[:, :, ::2, ::2].flatten())
    model.train()
    return (roc_auc_score(torch.cat(y_img).numpy(), torch.cat(s_img).numpy()),
            roc_auc_score(torch.cat(y_pix).numpy().astype(np.uint8), torch.cat(s_pix).numpy()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--category", required=True)
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.cfg:
        cfg.update(yaml.safe_load(open(args.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    work_dir = Path(cfg["work_dir"]) / args.category
    if rank == 0:
        work_dir.mkdir(parents=True, exist_ok=True)
        yaml.safe_dump(cfg, open(work_dir / "config.yaml", "w"))

    in_ch = 1 if cfg["grayscale"] else 3
    train_set = AnomalyFolder(cfg["data_root"], args.category, "train", cfg["image_size"], cfg["grayscale"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, num_workers=cfg["workers"],
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_set = AnomalyFolder(cfg["data_root"], args.category, "test", cfg["image_size"], cfg["grayscale"])
    test_loader = DataLoader(test_set, batch_size=32, shuffle=False, num_workers=cfg["workers"])

    model = MemAE(in_ch, cfg["mem_dim"], cfg["shrink_thres"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"], eta_min=1e-6)
    logger.info("train images: %d, world size: %d", len(train_set), world_size)

    best = {"image_auroc": 0.0}
    for epoch in range(cfg["epochs"]):
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for x, _, _ in train_loader:
            x = x.to(device, non_blocking=True)
            rec, att = model(x)
            rec_loss = F.mse_loss(rec, x)
            ent = entropy_loss(att)
            loss = rec_loss + cfg["entropy_weight"] * ent
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([rec_loss.detach(), ent.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)
        logger.info("epoch %03d rec %.5f ent %.4f lr %.2e (%.1fs)", epoch, acc[0] / acc[2], acc[1] / acc[2],
                    scheduler.get_last_lr()[0], time.time() - t0)

        if rank == 0 and ((epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == cfg["epochs"]):
            img_auc, pix_auc = evaluate(model.module, test_loader, device)
            logger.info("epoch %03d image AUROC %.4f pixel AUROC %.4f", epoch, img_auc, pix_auc)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "image_auroc": img_auc, "pixel_auroc": pix_auc}
            torch.save(ckpt, work_dir / "latest.pth")
            if img_auc > best["image_auroc"]:
                best = {"image_auroc": img_auc, "pixel_auroc": pix_auc, "epoch": epoch}
                torch.save(ckpt, work_dir / "best.pth")
        dist.barrier()

    if rank == 0:
        logger.info("best: %s", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
