"""Convolutional SSIM autoencoder for veneer-sheet surface inspection.

Sheets are photographed at ~4k x 3k; training uses the grid of 256 px tiles
of the nominal sheets (random flips only), testing slides over the whole
sheet and marks tiles whose residual SSIM map exceeds the threshold chosen on
the validation sheets.

    torchrun --nproc_per_node=4 ssim_ae.py --root /data/veneer --species oak --out /data/veneer/models
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
from PIL import Image
from pytorch_msssim import ssim
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

Image.MAX_IMAGE_PIXELS = None


class SheetTiles(Dataset):
    """Non-overlapping crop x crop tiles of every nominal sheet (grayscale, kept in RAM)."""

    def __init__(self, files, crop, scale):
        self.sheets, self.index = [], []
        for si, f in enumerate(files):
            img = Image.open(f).convert("L")
            img = img.resize((int(img.width * scale), int(img.height * scale)), Image.BILINEAR)
            self.sheets.append(torch.from_numpy(np.asarray(img).copy()))
            h, w = self.sheets[-1].shape
            self.index += [(si, y, x) for y in range(0, h - crop + 1, crop) for x in range(0, w - crop + 1, crop)]
        self.crop = crop

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        si, y, x = self.index[i]
        t = self.sheets[si][y:y + self.crop, x:x + self.crop].float().div(255).unsqueeze(0)
        if torch.rand(1).item() < 0.5:
            t = t.flip(-1)
        if torch.rand(1).item() < 0.5:
            t = t.flip(-2)
        return t


def enc_block(cin, cout, k, s, p):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p), nn.LeakyReLU(0.2, inplace=True))


def dec_block(cin, cout, k, s, p):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, k, s, p), nn.LeakyReLU(0.2, inplace=True))


class SSIMAE(nn.Module):
    """Architecture of Bergmann et al. (2019), latent 100."""

    def __init__(self, latent=100):
        super().__init__()
        self.encoder = nn.Sequential(
            enc_block(1, 32, 4, 2, 1), enc_block(32, 32, 4, 2, 1), enc_block(32, 32, 3, 1, 1),
            enc_block(32, 64, 4, 2, 1), enc_block(64, 64, 3, 1, 1), enc_block(64, 128, 4, 2, 1),
            enc_block(128, 64, 3, 1, 1), enc_block(64, 32, 3, 1, 1), nn.Conv2d(32, latent, 8, 1, 0))
        self.decoder = nn.Sequential(
            dec_block(latent, 32, 8, 1, 0), dec_block(32, 64, 3, 1, 1), dec_block(64, 128, 3, 1, 1),
            dec_block(128, 64, 4, 2, 1), dec_block(64, 64, 3, 1, 1), dec_block(64, 32, 4, 2, 1),
            dec_block(32, 32, 3, 1, 1), dec_block(32, 32, 4, 2, 1),
            nn.ConvTranspose2d(32, 1, 4, 2, 1), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x))


@torch.no_grad()
def sheet_residual(model, sheet, crop, stride, device):
    """Sliding-window SSIM residual over one full sheet; returns per-pixel max residual."""
    h, w = sheet.shape
    res = torch.zeros(h, w)
    ys = list(range(0, h - crop + 1, stride)) + ([h - crop] if (h - crop) % stride else [])
    xs = list(range(0, w - crop + 1, stride)) + ([w - crop] if (w - crop) % stride else [])
    tiles = [(y, x) for y in ys for x in xs]
    for i in range(0, len(tiles), 64):
        batch = tiles[i:i + 64]
        t = torch.stack([sheet[y:y + crop, x:x + crop] for y, x in batch]).float().div(255).unsqueeze(1).to(device)
        rec = model(t)
        smap = 1 - ssim(t, rec, data_range=1.0, size_average=False, win_size=11, nonnegative_ssim=True)
        pix = (t - rec).abs()[:, 0].cpu()
        for k, (y, x) in enumerate(batch):
            # SSIM gives one value per tile; the pixel residual localises inside the tile
            res[y:y + crop, x:x + crop] = torch.maximum(res[y:y + crop, x:x + crop], pix[k] * smap[k].item())
    return res


def load_sheet(path, scale):
    img = Image.open(path).convert("L")
    return torch.from_numpy(np.asarray(img.resize((int(img.width * scale), int(img.height * scale)))).copy())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--species", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size")
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(100)

    root = Path(args.root) / args.species
    train_files = sorted((root / "train" / "good").glob("*.png"))
    ds = SheetTiles(train_files, args.crop, args.scale)
    loader = DataLoader(ds, batch_size=args.batch_size // world, shuffle=True, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = DDP(SSIMAE().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

    out = Path(args.out) / args.species
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(out / "tb"))
        print(f"{len(train_files)} sheets, {len(ds)} tiles, {len(loader)} steps/epoch/rank")

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x in loader:
            x = x.to(device, non_blocking=True)
            rec = model(x)
            loss = 1 - ssim(x, rec, data_range=1.0, win_size=11)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            l = (acc[0] / acc[1]).item()
            writer.add_scalar("train/ssim_loss", l, epoch)
            print(f"epoch {epoch:3d} ssim-loss {l:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, out / "ae_last.pt")
        dist.barrier()

    if rank == 0:
        net = model.module.eval()
        # threshold = 99.5th percentile of residuals on nominal validation sheets
        val = [sheet_residual(net, load_sheet(f, args.scale), args.crop, args.crop // 2, device)
               for f in sorted((root / "val" / "good").glob("*.png"))]
        thr = torch.quantile(torch.cat([v.flatten()[::97] for v in val]), 0.995).item()
        labels, scores = [], []
        for sub in sorted((root / "test").iterdir()):
            for f in sorted(sub.glob("*.png")):
                r = sheet_residual(net, load_sheet(f, args.scale), args.crop, args.crop // 2, device)
                scores.append(F.avg_pool2d(r[None, None], 15, 1, 7).max().item())
                labels.append(int(sub.name != "good"))
        auroc = roc_auc_score(labels, scores)
        print(f"{args.species}: threshold {thr:.4f}, sheet AUROC {auroc:.4f} ({len(labels)} sheets)")
        writer.add_scalar("test/sheet_auroc", auroc, args.epochs)
        writer.close()
        torch.save({"model": net.state_dict(), "threshold": thr, "scale": args.scale, "crop": args.crop},
                   out / "ae_final.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
