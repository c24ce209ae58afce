"""DeepLabV3-ResNet50 semantic segmentation on Cityscapes-like data, one process per GPU via mp.spawn.

    python 05_deeplab_seg_spawn.py --config configs/deeplabv3_cityscapes.yaml
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.models import ResNet50_Weights

DEFAULTS = {
    "data_root": "/data/cityscapes",
    "num_classes": 19,
    "ignore_index": 255,
    "crop_size": 768,
    "batch_size": 4,          # per GPU
    "base_lr": 0.01,          # for a total batch of 16
    "iters": 40000,
    "workers": 6,
    "eval_every": 4000,
    "work_dir": "work_dirs/deeplabv3_r50_cityscapes",
    "dist_url": "tcp://127.0.0.1:29512",
    "seed": 304,
}

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SegDataset(Dataset):
    def __init__(self, root, split, crop_size, train):
        self.train = train
        self.crop = crop_size
        list_path = os.path.join(root, f"{split}.txt")
        with open(list_path) as f:
            self.pairs = [line.split() for line in f if line.strip()]
        self.root = root

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        img_rel, lbl_rel = self.pairs[i]
        img = Image.open(os.path.join(self.root, img_rel)).convert("RGB")
        lbl = Image.open(os.path.join(self.root, lbl_rel))
        if self.train:
            scale = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * scale), int(h * scale)
            img = img.resize((nw, nh), Image.BILINEAR)
            lbl = lbl.resize((nw, nh), Image.NEAREST)
            img, lbl = np.asarray(img, np.float32) / 255.0, np.asarray(lbl, np.int64)
            ph, pw = max(self.crop - nh, 0), max(self.crop - nw, 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=255)
            y = random.randint(0, img.shape[0] - self.crop)
            x = random.randint(0, img.shape[1] - self.crop)
            img = img[y:y + self.crop, x:x + self.crop]
            lbl = lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32) / 255.0, np.asarray(lbl, np.int64)
        img = (img - MEAN) / STD
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


def confusion(pred, target, n, ignore):
    mask = target != ignore
    return torch.bincount(n * target[mask] + pred[mask], minlength=n * n).view(n, n)


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    hist = torch.zeros(cfg["num_classes"], cfg["num_classes"], dtype=torch.long, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(img)["out"]
        pred = out.float().argmax(1)
        hist += confusion(pred.flatten(), lbl.flatten(), cfg["num_classes"], cfg["ignore_index"])
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


def main_worker(gpu, cfg):
    world_size = cfg["world_size"]
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=cfg["dist_url"], world_size=world_size, rank=gpu)
    device = torch.device("cuda", gpu)
    random.seed(cfg["seed"] + gpu)
    np.random.seed(cfg["seed"] + gpu)
    torch.manual_seed(cfg["seed"])

    train_set = SegDataset(cfg["data_root"], "train", cfg["crop_size"], train=True)
    val_set = SegDataset(cfg["data_root"], "val", cfg["crop_size"], train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=gpu, shuffle=True)
    val_part = Subset(val_set, list(range(gpu, len(val_set), world_size)))
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_part, batch_size=1, shuffle=False, num_workers=2)

    model = deeplabv3_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                               num_classes=cfg["num_classes"], aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])

    lr = cfg["base_lr"] * cfg["batch_size"] * world_size / 16
    backbone = [p for n, p in model.module.named_parameters() if n.startswith("backbone")]
    heads = [p for n, p in model.module.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.SGD([{"params": backbone, "lr": lr}, {"params": heads, "lr": lr * 10}],
                                lr=lr, momentum=0.9, weight_decay=1e-4)
    poly = lambda it: (1 - it / cfg["iters"]) ** 0.9
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, poly)
    criterion = nn.CrossEntropyLoss(ignore_index=cfg["ignore_index"])

    writer = SummaryWriter(cfg["work_dir"]) if gpu == 0 else None
    it, epoch, best_miou = 0, 0, 0.0
    t0 = time.time()
    while it < cfg["iters"]:
        train_sampler.set_epoch(epoch)
        for img, lbl in train_loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
                loss = criterion(out["out"].float(), lbl) + 0.4 * criterion(out["aux"].float(), lbl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if gpu == 0:
                    print(f"iter {it}/{cfg['iters']} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.5f} {(time.time() - t0) / 50:.3f}s/it", flush=True)
                    writer.add_scalar("train/loss", l.item(), it)
                t0 = time.time()

            if it % cfg["eval_every"] == 0 or it == cfg["iters"]:
                miou, per_class = evaluate(model.module, val_loader, cfg, device)
                if gpu == 0:
                    print(f"iter {it}: mIoU {miou * 100:.2f}", flush=True)
                    writer.add_scalar("val/mIoU", miou, it)
                    os.makedirs(cfg["work_dir"], exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "iter": it, "miou": miou},
                               os.path.join(cfg["work_dir"], "latest.pth"))
                    if miou > best_miou:
                        best_miou = miou
                        torch.save({"model": model.module.state_dict(), "iter": it, "miou": miou},
                                   os.path.join(cfg["work_dir"], "best.pth"))
                dist.barrier()
            if it >= cfg["iters"]:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["world_size"] = torch.cuda.device_count()
    os.makedirs(cfg["work_dir"], exist_ok=True)
    mp.spawn(main_worker, nprocs=cfg["world_size"], args=(cfg))


if __name__ == "__main__":
    main()
