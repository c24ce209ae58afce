"""DeepLabV3-R101 (torchvision) on Cityscapes, 769x769 crops, 2 images / GPU.

    torchrun --nproc_per_node=8 10_cityscapes_deeplabv3_r101.py --root /datasets/cityscapes
"""
import argparse
import os
import random
import time
from dataclasses import dataclass, asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet101_Weights
from torchvision.models.segmentation import deeplabv3_resnet101


@dataclass
class Config:
    root: str = "/datasets/cityscapes"
    work_dir: str = "work_dirs/dlv3_r101_769_cs"
    crop: int = 769
    batch_per_gpu: int = 2
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    max_iters: int = 80000
    aux_weight: float = 0.4
    eval_every: int = 8000
    num_workers: int = 4
    num_classes: int = 19
    ignore_index: int = 255
    seed: int = 7


def get_config():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


class CityscapesTrainIds(Dataset):
    MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __init__(self, root, split, crop=769, ignore=255, train=True):
        self.images = sorted(Path(root, "leftImg8bit", split).glob("*/*_leftImg8bit.png"))
        self.crop, self.ignore, self.train = crop, ignore, train

    def __len__(self):
        return len(self.images)

    def label_path(self, p):
        return str(p).replace("leftImg8bit/", "gtFine/").replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png")

    def __getitem__(self, idx):
        img = Image.open(self.images[idx]).convert("RGB")
        lbl = Image.open(self.label_path(self.images[idx]))
        if self.train:
            s = random.uniform(0.5, 2.0)
            size = (int(img.width * s), int(img.height * s))
            img = img.resize(size, Image.BILINEAR)
            lbl = lbl.resize(size, Image.NEAREST)
            canvas_w, canvas_h = max(size[0], self.crop), max(size[1], self.crop)
            img_c = Image.new("RGB", (canvas_w, canvas_h))
            lbl_c = Image.new("L", (canvas_w, canvas_h), self.ignore)
            img_c.paste(img, (0, 0))
            lbl_c.paste(lbl, (0, 0))
            x = random.randint(0, canvas_w - self.crop)
            y = random.randint(0, canvas_h - self.crop)
            img = img_c.crop((x, y, x + self.crop, y + self.crop))
            lbl = lbl_c.crop((x, y, x + self.crop, y + self.crop))
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                lbl = lbl.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img, np.float32) / 255.0).permute(2, 0, 1)
        x = (x - self.MEAN) / self.STD
        return x, torch.from_numpy(np.asarray(lbl, np.int64).copy())


def confusion(pred, target, n, ignore):
    k = target != ignore
    return torch.bincount(target[k] * n + pred[k], minlength=n * n).view(n, n)


@torch.no_grad()
def run_eval(net, loader, cfg, device, crop=769, stride=513):
    net.eval()
    n = cfg.num_classes
    hist = torch.zeros(n, n, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        _, _, H, W = img.shape
        logits = torch.zeros(1, n, H, W, device=device)
        counts = torch.zeros(1, 1, H, W, device=device)
        ys = list(range(0, H - crop, stride)) + [H - crop]
        xs = list(range(0, W - crop, stride)) + [W - crop]
        for y in ys:
            for x in xs:
                logits[..., y:y + crop, x:x + crop] += net(img[..., y:y + crop, x:x + crop])["out"]
                counts[..., y:y + crop, x:x + crop] += 1
        hist += confusion((logits / counts).argmax(1), lbl, n, cfg.ignore_index)
    dist.all_reduce(hist)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    net.train()
    return iou


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)
    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        print(cfg, flush=True)

    train_ds = CityscapesTrainIds(cfg.root, "train", cfg.crop, cfg.ignore_index, train=True)
    val_ds = CityscapesTrainIds(cfg.root, "val", cfg.crop, cfg.ignore_index, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_per_gpu, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)

    model = deeplabv3_resnet101(weights=None, weights_backbone=ResNet101_Weights.IMAGENET1K_V2,
                                num_classes=cfg.num_classes, aux_loss=True)
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    params = [
        {"params": model.backbone.parameters(), "lr": cfg.lr},
        {"params": list(model.classifier.parameters()) + list(model.aux_classifier.parameters()),
         "lr": cfg.lr * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    init_lrs = [g["lr"] for g in optimizer.param_groups]
    criterion = nn.CrossEntropyLoss(ignore_index=cfg.ignore_index)

    it, epoch, best = 0, 0, 0.0
    t_last = time.time()
    ddp_model.train()
    while it < cfg.max_iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            for g, base in zip(optimizer.param_groups, init_lrs):
                g["lr"] = base * (1 - it / cfg.max_iters) ** 0.9
            img = img.to(device, non_blocking=True)
            lbl = lbl.to(device, non_blocking=True)
            out = ddp_model(img)
            loss = criterion(out["out"], lbl) + cfg.aux_weight * criterion(out["aux"], lbl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t_last) / 100
                    print(f"[{it}/{cfg.max_iters}] loss {l.item():.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.2e} {dt:.3f}s/it "
                          f"eta {dt * (cfg.max_iters - it) / 3600:.1f}h", flush=True)
                t_last = time.time()

            if it % cfg.eval_every == 0 or it == cfg.max_iters:
                iou = run_eval(model, val_loader, cfg, device)
                miou = torch.nanmean(iou).item()
                if rank == 0:
                    print(f"eval @ {it}: mIoU = {miou * 100:.2f}", flush=True)
                    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter": it}
                    torch.save(ckpt, os.path.join(cfg.work_dir, "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save(ckpt, os.path.join(cfg.work_dir, "best.pth"))
                dist.barrier()
            if it >= cfg.max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
