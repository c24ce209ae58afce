"""Crop / weed / soil segmentation on WeedMap-style multispectral orthomosaic tiles.

Input is 5 channels (R, G, B, RedEdge, NIR) at full tile resolution; the
weed class is thin and sparse, so tiles are trained at 768x768 without
downsampling and with class-weighted CE + Dice.

    torchrun --nproc_per_node=8 09_weedmap_deeplab_seg.py --data /data/weedmap --batch-size 2
"""
import argparse
import os
import time
from glob import glob

import numpy as np
import segmentation_models_pytorch as smp
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 3  # soil, crop, weed
CLASS_WEIGHTS = [0.35, 1.0, 3.5]
IGNORE = 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--train-orthos", nargs="+", default=["000", "001", "002", "004"])
    p.add_argument("--val-orthos", nargs="+", default=["003"])
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--save-dir", default="work_dirs/weedmap_dlv3p")
    return p.parse_args()


class WeedMapTiles(Dataset):
    def __init__(self, root, orthos, crop, train):
        self.items = []
        for o in orthos:
            for img in sorted(glob(os.path.join(root, o, "tile", "*.tif"))):
                self.items.append((img, img.replace("/tile/", "/groundtruth/").replace(".tif", ".png")))
        self.crop = crop
        self.train = train
        stats = np.load(os.path.join(root, "band_stats.npz"))
        self.mean = stats["mean"].astype(np.float32)[:, None, None]
        self.std = stats["std"].astype(np.float32)[:, None, None]

    def __len__(self):
        return len(self.items)

    def _random_crop(self, x, y):
        _, h, w = x.shape
        c = self.crop
        top = np.random.randint(0, h - c + 1)
        left = np.random.randint(0, w - c + 1)
        return x[:, top:top + c, left:left + c], y[top:top + c, left:left + c]

    def __getitem__(self, i):
        img_path, gt_path = self.items[i]
        x = tifffile.imread(img_path).astype(np.float32).transpose(2, 0, 1)  # 5,H,W
        y = np.array(Image.open(gt_path), dtype=np.int64)
        x = (x - self.mean) / self.std
        if self.train:
            x, y = self._random_crop(x, y)
            k = np.random.randint(4)
            x, y = np.rot90(x, k, axes=(1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            x = x * np.random.uniform(0.9, 1.1, size=(x.shape[0], 1, 1)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def dice_loss(logits, target, eps=1.0):
    valid = (target != IGNORE).unsqueeze(1)
    probs = logits.softmax(1) * valid
    onehot = F.one_hot(target.clamp(max=NUM_CLASSES - 1), NUM_CLASSES).permute(0, 3, 1, 2).float() * valid
    inter = (probs * onehot).sum((0, 2, 3))
    union = probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1 - ((2 * inter + eps) / (union + eps)).mean()


@torch.no_grad()
def sliding_eval(net, ds, device, rank, world, win=768, stride=512):
    """Evaluate full tiles with a sliding window; tiles are split across ranks."""
    net.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for i in range(rank, len(ds), world):
        x, y = ds[i]
        x, y = x.to(device)[None], y.to(device)
        _, _, H, W = x.shape
        logits = torch.zeros(1, NUM_CLASSES, H, W, device=device)
        count = torch.zeros(1, 1, H, W, device=device)
        for top in list(range(0, max(H - win, 0) + 1, stride)) + ([H - win] if H > win else []):
            for left in list(range(0, max(W - win, 0) + 1, stride)) + ([W - win] if W > win else []):
                patch = x[:, :, top:top + win, left:left + win]
                logits[:, :, top:top + win, left:left + win] += net(patch).float()
                count[:, :, top:top + win, left:left + win] += 1
        pred = (logits / count).argmax(1)[0]
        m = y != IGNORE
        conf += torch.bincount(y[m] * NUM_CLASSES + pred[m], minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, -1)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    return iou.cpu().numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    train_ds = WeedMapTiles(args.data, args.train_orthos, args.crop, train=True)
    val_ds = WeedMapTiles(args.data, args.val_orthos, args.crop, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = smp.DeepLabV3Plus(encoder_name="resnet50", encoder_weights="imagenet", in_channels=5,
                            classes=NUM_CLASSES).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total_iters = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / total_iters) ** 0.9)
    ce = nn.CrossEntropyLoss(weight=torch.tensor(CLASS_WEIGHTS, device=device), ignore_index=IGNORE)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_miou = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            out = out.float()
            loss = ce(out, y) + dice_loss(out, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += loss.detach()
        dist.all_reduce(running, op=dist.ReduceOp.AVG)

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            iou = sliding_eval(net, val_ds, device, rank, world, win=args.crop)
            miou = float(iou.mean())
            if rank == 0:
                print(f"ep {epoch} loss {running.item() / len(loader):.4f} IoU soil/crop/weed "
                      f"{iou[0]:.3f}/{iou[1]:.3f}/{iou[2]:.3f} mIoU {miou:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if miou > best_miou:
                    best_miou = miou
                    torch.save({"state_dict": net.state_dict(), "epoch": epoch, "miou": miou},
                               os.path.join(args.save_dir, "best.pth"))
            dist.barrier()
        elif rank == 0:
            print(f"ep {epoch} loss {running.item() / len(loader):.4f} ({time.time() - t0:.0f}s)", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
