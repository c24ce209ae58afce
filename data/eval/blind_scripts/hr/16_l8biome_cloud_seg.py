"""Cloud / cloud-shadow segmentation on Landsat-8 Biome scenes (11 bands, ~8000x8000 px).

The Biome masks use raw codes (0 fill, 64 shadow, 128 clear, 192 thin cloud,
255 cloud). A number of Biome scenes were delivered with zero-filled thermal bands
(B10/B11), so only bands that carry data in every loaded scene are used as inputs.

Scenes are too large to keep all of them in every process, so each process keeps only
its own share of the training scenes in RAM and samples crops from those.

    torchrun --nproc_per_node=8 16_l8biome_cloud_seg.py --scenes /data/l8biome/scenes
"""
import argparse
import glob
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import segmentation_models_pytorch as smp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

FILL_CODE = 0
BANDS = ["B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B9", "B10", "B11"]
CLASS_CODES = {128: 0, 192: 1, 255: 2, 64: 3}  # clear, thin, thick, shadow
NUM_CLASSES = len(CLASS_CODES)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scenes", default="/data/l8biome/scenes")
    p.add_argument("--val-list", default="/data/l8biome/val_scenes.txt")
    p.add_argument("--out", default="/data/l8biome/runs/unet_effb3")
    p.add_argument("--crop", type=int, default=384)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--steps", type=int, default=800, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args()


def load_scene(scene_dir):
    name = os.path.basename(scene_dir)
    with rasterio.open(os.path.join(scene_dir, f"{name}_stack.tif")) as src:
        img = src.read().astype(np.uint16)  # (11, H, W) DN
    with rasterio.open(os.path.join(scene_dir, f"{name}_fixedmask.tif")) as src:
        mask = src.read(1)
    return img, mask


def toa_normalise(x):
    return np.clip(x.astype(np.float32) / 65535.0 * 2.0 - 0.1, -0.1, 1.5)


class SceneCrops(Dataset):
    def __init__(self, scenes, lut, bands, crop, length):
        self.scenes, self.lut, self.bands, self.crop, self.length = scenes, lut, bands, crop, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        img, mask = self.scenes[np.random.randint(len(self.scenes))]
        h, w = mask.shape
        for _ in range(20):  # avoid crops that are mostly fill
            y, x = np.random.randint(0, h - self.crop), np.random.randint(0, w - self.crop)
            m = mask[y:y + self.crop, x:x + self.crop]
            if (m != FILL_CODE).mean() > 0.7:
                break
        im = toa_normalise(img[self.bands, y:y + self.crop, x:x + self.crop])
        lab = self.lut[m]
        k = np.random.randint(4)
        im, lab = np.rot90(im, k, (1, 2)), np.rot90(lab, k)
        return torch.from_numpy(im.copy()), torch.from_numpy(lab.astype(np.int64))


def build_lut():
    lut = np.full(256, 255, dtype=np.uint8)
    for code, cls in CLASS_CODES.items():
        lut[code] = cls
    return lut


def usable_bands(images):
    """Indices of bands that are not zero-filled in any of the given scenes."""
    keep = []
    for b in range(len(BANDS)):
        if all(img[b, ::16, ::16].any() for img in images):
            keep.append(b)
    return keep


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.val_list) as f:
        val_names = {l.strip() for l in f if l.strip()}
    all_dirs = sorted(glob.glob(os.path.join(args.scenes, "*")))
    train_dirs = [d for d in all_dirs if os.path.basename(d) not in val_names]
    val_dirs = [d for d in all_dirs if os.path.basename(d) in val_names]

    t0 = time.time()
    my_scenes = [load_scene(d) for d in train_dirs[rank::world]]
    lut = build_lut()
    bands = usable_bands([img for img, _ in my_scenes])
    print(f"[rank {rank}] {len(my_scenes)} scenes in RAM, bands {[BANDS[b] for b in bands]} "
          f"({time.time() - t0:.0f}s)", flush=True)

    train_ds = SceneCrops(my_scenes, lut, bands, args.crop, args.steps * args.bs)
    dl = DataLoader(train_ds, batch_size=args.bs, shuffle=False, num_workers=6, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    model = smp.Unet("efficientnet-b3", encoder_weights=None, in_channels=len(bands), classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(dl))
    crit = nn.CrossEntropyLoss(ignore_index=255)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for img, lab in dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(img), lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        # validation: center 2048 window of every val scene, split across ranks
        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for d in val_dirs[rank::world]:
                img, mask = load_scene(d)
                h, w = mask.shape
                y0, x0 = (h - 2048) // 2, (w - 2048) // 2
                im = torch.from_numpy(toa_normalise(img[bands, y0:y0 + 2048, x0:x0 + 2048]))[None].to(device)
                lab = torch.from_numpy(lut[mask[y0:y0 + 2048, x0:x0 + 2048]].astype(np.int64)).to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(im).argmax(1)[0]
                v = lab != 255
                acc += torch.stack([(pred[v] == lab[v]).sum(), v.sum()]).double()
        dist.all_reduce(acc)
        val_acc = (acc[0] / acc[1].clamp(min=1)).item()

        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} val pixel acc {val_acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "bands": [BANDS[b] for b in bands], "epoch": epoch, "val_acc": val_acc}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
