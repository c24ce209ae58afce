"""UperNet + ConvNeXt-T on ADE20K-150 (512x512, 160k iters, AdamW, AMP).

    torchrun --nproc_per_node=8 08_ade20k_upernet_convnext.py --cfg configs/upernet_convnext_t_ade.yaml
"""
import argparse
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CFG = {
    "data_root": "/datasets/ADEChallengeData2016",
    "num_classes": 150,
    "ignore_index": 255,
    "crop": 512,
    "samples_per_gpu": 2,
    "lr": 1e-4,
    "weight_decay": 0.05,
    "warmup": 1500,
    "iters": 160000,
    "aux_weight": 0.4,
    "eval_interval": 16000,
    "work_dir": "work_dirs/upernet_convnext_t_ade",
}


def conv_bn_relu(i, o, k=3):
    return nn.Sequential(nn.Conv2d(i, o, k, padding=k // 2, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))


class UPerHead(nn.Module):
    def __init__(self, in_chs, ch=512, num_classes=150, scales=(1, 2, 3, 6)):
        super().__init__()
        self.ppm = nn.ModuleList([nn.Sequential(nn.AdaptiveAvgPool2d(s), conv_bn_relu(in_chs[-1], ch, 1))
                                  for s in scales])
        self.bottleneck = conv_bn_relu(in_chs[-1] + len(scales) * ch, ch)
        self.lateral = nn.ModuleList([conv_bn_relu(c, ch, 1) for c in in_chs[:-1]])
        self.fpn = nn.ModuleList([conv_bn_relu(ch, ch) for _ in in_chs[:-1]])
        self.fuse = conv_bn_relu(len(in_chs) * ch, ch)
        self.cls = nn.Sequential(nn.Dropout2d(0.1), nn.Conv2d(ch, num_classes, 1))

    def forward(self, feats):
        top = feats[-1]
        psp = [top] + [F.interpolate(p(top), top.shape[-2:], mode="bilinear", align_corners=False) for p in self.ppm]
        lat = [l(f) for l, f in zip(self.lateral, feats[:-1])] + [self.bottleneck(torch.cat(psp, 1))]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], lat[i - 1].shape[-2:], mode="bilinear", align_corners=False)
        outs = [self.fpn[i](lat[i]) for i in range(len(lat) - 1)] + [lat[-1]]
        size = outs[0].shape[-2:]
        outs = [outs[0]] + [F.interpolate(o, size, mode="bilinear", align_corners=False) for o in outs[1:]]
        return self.cls(self.fuse(torch.cat(outs, 1)))


class UperNetConvNeXt(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny.fb_in22k_ft_in1k", pretrained=True,
                                          features_only=True, drop_path_rate=0.4)
        chs = self.backbone.feature_info.channels()
        self.decode_head = UPerHead(chs, 512, num_classes)
        self.aux_head = nn.Sequential(conv_bn_relu(chs[2], 256), nn.Dropout2d(0.1), nn.Conv2d(256, num_classes, 1))

    def forward(self, x):
        feats = self.backbone(x)
        out = F.interpolate(self.decode_head(feats), x.shape[-2:], mode="bilinear", align_corners=False)
        if self.training:
            aux = F.interpolate(self.aux_head(feats[2]), x.shape[-2:], mode="bilinear", align_corners=False)
            return out, aux
        return out


class ADE20KDataset(Dataset):
    """ADEChallengeData2016 layout: images/{training,validation}/*.jpg, annotations/.../*.png"""

    MEAN = np.array([123.675, 116.28, 103.53], np.float32)
    STD = np.array([58.395, 57.12, 57.375], np.float32)

    def __init__(self, root, split, crop, ignore_index, train):
        sub = {"train": "training", "val": "validation"}[split]
        self.img_dir = os.path.join(root, "images", sub)
        self.ann_dir = os.path.join(root, "annotations", sub)
        self.ids = sorted(os.path.splitext(f)[0] for f in os.listdir(self.img_dir))
        self.crop, self.ignore, self.train = crop, ignore_index, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.ids[i] + ".jpg")).convert("RGB")
        seg = Image.open(os.path.join(self.ann_dir, self.ids[i] + ".png"))
        w, h = img.size
        if self.train:
            ratio = random.uniform(0.5, 2.0)
            scale = min(2048 * ratio / max(w, h), 512 * ratio / min(w, h))
            size = (int(w * scale + 0.5), int(h * scale + 0.5))
            img = np.asarray(img.resize(size, Image.BILINEAR), np.float32)
            seg = np.asarray(seg.resize(size, Image.NEAREST), np.int64)
            ph, pw = max(self.crop - seg.shape[0], 0), max(self.crop - seg.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            seg = np.pad(seg, ((0, ph), (0, pw)), constant_values=self.ignore)
            y = random.randint(0, seg.shape[0] - self.crop)
            x = random.randint(0, seg.shape[1] - self.crop)
            img, seg = img[y:y + self.crop, x:x + self.crop], seg[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, seg = img[:, ::-1], seg[:, ::-1]
        else:
            scale = min(2048 / max(w, h), 512 / min(w, h))
            img = np.asarray(img.resize((int(w * scale + 0.5), int(h * scale + 0.5)), Image.BILINEAR), np.float32)
            seg = np.asarray(seg, np.int64)
        img = (img - self.MEAN) / self.STD
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(seg.copy())


@torch.no_grad()
def evaluate(net, loader, n, ignore, device):
    net.eval()
    area = torch.zeros(3, n, dtype=torch.float64, device=device)  # intersect, pred, label
    for img, seg in loader:
        img, seg = img.to(device), seg.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logit = net(img)
        pred = F.interpolate(logit.float(), seg.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
        m = seg != ignore
        p, t = pred[m], seg[m]
        area[0] += torch.bincount(t[p == t], minlength=n).double()
        area[1] += torch.bincount(p, minlength=n).double()
        area[2] += torch.bincount(t, minlength=n).double()
    dist.all_reduce(area)
    iou = area[0] / (area[1] + area[2] - area[0])
    net.train()
    return torch.nanmean(iou).item(), (area[0].sum() / area[2].sum()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = dict(CFG)
    if cli.cfg:
        cfg.update(yaml.safe_load(open(cli.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    n_cls, ign = cfg["num_classes"], cfg["ignore_index"]
    train_ds = ADE20KDataset(cfg["data_root"], "train", cfg["crop"], ign, True)
    val_ds = ADE20KDataset(cfg["data_root"], "val", cfg["crop"], ign, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, cfg["samples_per_gpu"], sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), 1, num_workers=2)

    net = UperNetConvNeXt(n_cls)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    decay = [p for n, p in net.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in net.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"])
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(ignore_index=ign)

    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)
        with open(os.path.join(cfg["work_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    it, ep, best = 0, 0, 0.0
    t0 = time.time()
    while it < cfg["iters"]:
        sampler.set_epoch(ep)
        for img, seg in loader:
            if it < cfg["warmup"]:
                lr = cfg["lr"] * (1e-6 + (1 - 1e-6) * it / cfg["warmup"])
            else:
                lr = cfg["lr"] * (1 - it / cfg["iters"])
            for g in opt.param_groups:
                g["lr"] = lr
            img, seg = img.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out, aux = model(img)
                loss = criterion(out.float(), seg) + cfg["aux_weight"] * criterion(aux.float(), seg)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            it += 1
            if it % 50 == 0 and rank == 0:
                print(f"it {it:6d} loss {loss.item():.4f} lr {lr:.2e} scale {scaler.get_scale():.0f} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()
            if it % cfg["eval_interval"] == 0 or it == cfg["iters"]:
                miou, aacc = evaluate(net, val_loader, n_cls, ign, device)
                if rank == 0:
                    print(f"[val] it {it} mIoU {100 * miou:.2f} aAcc {100 * aacc:.2f}", flush=True)
                    state = {"model": net.state_dict(), "opt": opt.state_dict(),
                             "scaler": scaler.state_dict(), "iter": it}
                    torch.save(state, os.path.join(cfg["work_dir"], "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save(state, os.path.join(cfg["work_dir"], "best.pth"))
                dist.barrier()
            if it >= cfg["iters"]:
                break
        ep += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
