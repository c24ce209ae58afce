"""Convolutional autoencoder baseline for MVTec AD (reconstruction error = anomaly score).

    torchrun --standalone --nproc_per_node=8 04_ae_recon_mvtec.py --config configs/ae_hazelnut.yaml
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
import yaml
from PIL import Image
from pytorch_msssim import ssim
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T

DEFAULTS = {
    "data_root": "/mnt/datasets/mvtec_ad",
    "category": "hazelnut",
    "img_size": 256,
    "latent_dim": 512,
    "batch_size": 32,
    "epochs": 300,
    "lr": 2e-4,
    "weight_decay": 1e-5,
    "ssim_weight": 0.5,
    "num_workers": 6,
    "eval_interval": 20,
    "out_dir": "work_dirs/ae",
}


class MVTecAD(Dataset):
    def __init__(self, root, category, train, img_size):
        self.root = Path(root) / category
        split = "train" if train else "test"
        self.files = sorted((self.root / split).glob("*/*.png"))
        aug = [T.RandomHorizontalFlip(), T.RandomVerticalFlip()] if train else []
        self.tf = T.Compose([T.Resize((img_size, img_size))] + aug + [T.ToTensor()])
        self.mask_tf = T.Compose([T.Resize((img_size, img_size), T.InterpolationMode.NEAREST), T.ToTensor()])
        self.img_size = img_size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        f = self.files[idx]
        img = self.tf(Image.open(f).convert("RGB"))
        defect = f.parent.name
        if defect == "good":
            return img, torch.zeros(1, self.img_size, self.img_size), 0
        gt = self.root / "ground_truth" / defect / f"{f.stem}_mask.png"
        return img, (self.mask_tf(Image.open(gt)) > 0.5).float(), 1


class ConvAE(nn.Module):
    def __init__(self, latent_dim=512):
        super().__init__()
        chans = [3, 32, 64, 128, 256, 256]
        enc = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            enc += [nn.Conv2d(cin, cout, 4, 2, 1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, inplace=True)]
        self.encoder = nn.Sequential(*enc, nn.Conv2d(256, latent_dim, 8))  # 8x8 -> 1x1
        dec = [nn.ConvTranspose2d(latent_dim, 256, 8), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
        rchans = chans[::-1]
        for cin, cout in zip(rchans[:-2], rchans[1:-1]):
            dec += [nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        dec += [nn.ConvTranspose2d(rchans[-2], 3, 4, 2, 1), nn.Sigmoid()]
        self.decoder = nn.Sequential(*dec)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--opts", nargs="*", default=[], help="key=value overrides")
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in args.opts:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if k in DEFAULTS else v
    return cfg


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    scores, labels, pix_scores, pix_labels = [], [], [], []
    for img, mask, label in loader:
        img = img.to(device, non_blocking=True)
        rec = model(img)
        err = ((img - rec) ** 2).mean(dim=1, keepdim=True)
        err = F.avg_pool2d(err, 11, stride=1, padding=5)
        scores.append(err.flatten(1).amax(dim=1).cpu())
        labels.append(label)
        pix_scores.append(err.flatten().cpu())
        pix_labels.append(mask.flatten())
    model.train()
    scores, labels = torch.cat(scores).numpy(), torch.cat(labels).numpy()
    pix_scores, pix_labels = torch.cat(pix_scores).numpy(), torch.cat(pix_labels).numpy().astype(np.uint8)
    return roc_auc_score(labels, scores), roc_auc_score(pix_labels, pix_scores)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    out_dir = Path(cfg["out_dir"]) / cfg["category"]
    writer = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(out_dir / "tb"))
        with open(out_dir / "config.yaml", "w") as f:
            yaml.safe_dump(cfg, f)

    train_ds = MVTecAD(cfg["data_root"], cfg["category"], True, cfg["img_size"])
    test_ds = MVTecAD(cfg["data_root"], cfg["category"], False, cfg["img_size"])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=cfg["batch_size"], sampler=test_sampler,
                             num_workers=cfg["num_workers"], pin_memory=True)

    model = ConvAE(cfg["latent_dim"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"])

    best_auroc = 0.0
    global_step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for img, _, _ in train_loader:
            img = img.to(device, non_blocking=True)
            rec = model(img)
            mse = F.mse_loss(rec, img)
            ssim_l = 1.0 - ssim(rec, img, data_range=1.0, size_average=True)
            loss = mse + cfg["ssim_weight"] * ssim_l
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if rank == 0 and global_step % 20 == 0:
                writer.add_scalar("train/mse", mse.item(), global_step)
                writer.add_scalar("train/ssim", ssim_l.item(), global_step)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch:04d} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"time {time.time() - tic:.1f}s", flush=True)

        if (epoch + 1) % cfg["eval_interval"] == 0 or epoch + 1 == cfg["epochs"]:
            img_auroc, pix_auroc = evaluate(model, test_loader, device)
            if rank == 0:
                writer.add_scalar("eval/image_auroc", img_auroc, epoch)
                writer.add_scalar("eval/pixel_auroc", pix_auroc, epoch)
                print(f"[eval] epoch {epoch} image AUROC {img_auroc:.4f} pixel AUROC {pix_auroc:.4f}", flush=True)
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "cfg": cfg}
                torch.save(state, out_dir / "last.pth")
                if img_auroc > best_auroc:
                    best_auroc = img_auroc
                    torch.save(state, out_dir / "best.pth")

    if rank == 0:
        writer.close()
        print(f"best image AUROC {best_auroc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
