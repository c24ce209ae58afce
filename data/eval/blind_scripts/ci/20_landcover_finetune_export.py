"""Fine-tune a land-cover model on regional Sentinel-2 patches, then map whole scenes.

Stage 1: fine-tune on 256 px patches (DDP).
Stage 2: load the best weights into a plain model and predict the full
         scenes listed in --predict-list with overlapping tiles; each rank maps
         its share of the scenes and writes a Cloud-Optimised GeoTIFF.

    torchrun --nproc_per_node=4 20_landcover_finetune_export.py \
        --patches /srv/geo/ft_patches --init /srv/geo/models/s2_lc_pretrain.pt \
        --predict-list /srv/geo/scenes_2023.txt --out /srv/geo/ft_run
"""
import argparse
import os

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

N_CLASSES = 8
BANDS = [2, 3, 4, 5, 6, 7, 8, 9, 12, 13]      # B2..B8A, B11, B12 in the L2A stacks (1-based)
MEAN = np.array([1100, 1030, 1000, 1300, 1900, 2150, 2250, 2350, 1950, 1400], np.float32)[:, None, None]
STD = np.array([700, 650, 720, 700, 760, 850, 900, 930, 880, 800], np.float32)[:, None, None]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patches", required=True)
    ap.add_argument("--init", required=True, help="pre-trained weights (plain state_dict)")
    ap.add_argument("--predict-list", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--overlap", type=int, default=64)
    return ap.parse_args()


def build_model():
    return smp.Unet("resnext50_32x4d", encoder_weights=None, in_channels=len(BANDS), classes=N_CLASSES)


class Patches(Dataset):
    def __init__(self, root, split, augment):
        self.dir = os.path.join(root, split)
        self.names = sorted(n for n in os.listdir(self.dir) if n.endswith("_img.tif"))
        self.augment = augment

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        with rasterio.open(os.path.join(self.dir, n)) as s:
            x = (s.read(BANDS).astype(np.float32) - MEAN) / STD
        with rasterio.open(os.path.join(self.dir, n.replace("_img", "_lbl"))) as s:
            y = s.read(1).astype(np.int64)
        if self.augment:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


@torch.no_grad()
def predict_scene(net, src_path, dst_path, device, tile, overlap):
    """Overlapping-tile inference over a whole scene with linear blending at the seams."""
    ramp = torch.ones(tile, device=device)
    ramp[:overlap] = torch.linspace(0.05, 1, overlap, device=device)
    ramp[-overlap:] = torch.linspace(1, 0.05, overlap, device=device)
    weight = ramp[:, None] * ramp[None, :]
    with rasterio.open(src_path) as src:
        H, W = src.height, src.width
        profile = src.profile.copy()
        probs = torch.zeros(N_CLASSES, H, W, device=device, dtype=torch.float16)
        norm = torch.zeros(H, W, device=device, dtype=torch.float16)
        step = tile - overlap
        for y in range(0, max(H - overlap, 1), step):
            for x in range(0, max(W - overlap, 1), step):
                y0, x0 = min(y, max(H - tile, 0)), min(x, max(W - tile, 0))
                win = Window(x0, y0, min(tile, W), min(tile, H))
                arr = (src.read(BANDS, window=win, boundless=True, fill_value=0).astype(np.float32) - MEAN) / STD
                inp = torch.from_numpy(arr)[None].to(device)
                h, w = inp.shape[-2:]
                inp = F.pad(inp, (0, tile - w, 0, tile - h))
                p = torch.softmax(net(inp)[0], 0)[:, :h, :w]
                wgt = weight[:h, :w]
                probs[:, y0:y0 + h, x0:x0 + w] += (p * wgt).half()
                norm[y0:y0 + h, x0:x0 + w] += wgt.half()
    label = (probs / norm.clamp(min=1e-3)).argmax(0).byte().cpu().numpy()
    profile.update(driver="COG", count=1, dtype="uint8", nodata=255, compress="deflate")
    with rasterio.open(dst_path, "w", **profile) as dst:
        dst.write(label, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = Patches(args.patches, "train", True), Patches(args.patches, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        args.batch_size, num_workers=8)

    net = build_model()
    net.load_state_dict(torch.load(args.init, map_location="cpu"))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    best_path = os.path.join(args.out, "best_model.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()

        net.eval()
        cm = torch.zeros(N_CLASSES, N_CLASSES, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                p = net(x).argmax(1)
                m = y != 255
                cm += torch.bincount(y[m] * N_CLASSES + p[m], minlength=N_CLASSES ** 2).view(N_CLASSES, N_CLASSES)
        dist.all_reduce(cm)
        cm = cm.double()
        iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
        miou = iou.mean().item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} mIoU {miou:.4f} "
                  f"per-class {[round(v, 3) for v in iou.tolist()]}", flush=True)
            if miou > best:
                torch.save(model.state_dict(), best_path)
                print(f"  saved new best to {best_path}", flush=True)
        best = max(best, miou)
        dist.barrier()

    if args.predict_list:
        with open(args.predict_list) as f:
            scenes = [l.strip() for l in f if l.strip()]
        mapper = build_model()
        mapper.load_state_dict(torch.load(best_path, map_location="cpu"))
        mapper = mapper.to(device).eval()
        out_dir = os.path.join(args.out, "maps")
        os.makedirs(out_dir, exist_ok=True)
        for scene in scenes[rank::world]:
            dst = os.path.join(out_dir, os.path.basename(scene).replace(".tif", "_lc.tif"))
            predict_scene(mapper, scene, dst, device, args.tile, args.overlap)
            print(f"[rank {rank}] wrote {dst}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
