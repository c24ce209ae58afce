"""SegFormer-B2 on ADE20K (150 classes), 512x512, 160k iterations.

Uses the HF transformers implementation of MiT + all-MLP head.
    torchrun --nproc_per_node=8 03_ade20k_segformer.py --config configs/segformer_b2_ade.yaml
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import SegformerForSemanticSegmentation

IGNORE = 255
MEAN = np.array([123.675, 116.28, 103.53], dtype=np.float32)
STD = np.array([58.395, 57.12, 57.375], dtype=np.float32)

DEFAULTS = dict(
    data_root="/datasets/ADEChallengeData2016",
    backbone="nvidia/mit-b2",
    num_classes=150,
    crop_size=512,
    batch_size=2,
    lr=6e-5,
    head_lr_mult=10.0,
    weight_decay=0.01,
    warmup_iters=1500,
    max_iters=160000,
    eval_interval=16000,
    workers=4,
    work_dir="work_dirs/segformer_b2_ade",
)


def load_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    args = p.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def to_tensor(img):
    x = (np.asarray(img, dtype=np.float32) - MEAN) / STD
    return torch.from_numpy(x.transpose(2, 0, 1).copy())


class ADE20K(Dataset):
    def __init__(self, root, split, crop_size=512, train=True):
        sub = "training" if split == "train" else "validation"
        self.img_dir = os.path.join(root, "images", sub)
        self.ann_dir = os.path.join(root, "annotations", sub)
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.crop = crop_size
        self.train = train

    def __len__(self):
        return len(self.names)

    def load(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        ann = np.array(Image.open(os.path.join(self.ann_dir, self.names[i] + ".png")), dtype=np.int64)
        # reduce_zero_label: 0 (other) -> ignore, 1..150 -> 0..149
        ann = ann - 1
        ann[ann < 0] = IGNORE
        return img, Image.fromarray(ann.astype(np.uint8))

    def __getitem__(self, i):
        img, ann = self.load(i)
        if self.train:
            ratio = random.uniform(0.5, 2.0)
            w, h = img.size
            scale = min(2048 * ratio / max(w, h), 512 * ratio / min(w, h))
            size = (int(w * scale + 0.5), int(h * scale + 0.5))
            img, ann = img.resize(size, Image.BILINEAR), ann.resize(size, Image.NEAREST)
            img, ann = np.asarray(img), np.asarray(ann)
            h, w = ann.shape
            ph, pw = max(self.crop - h, 0), max(self.crop - w, 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            ann = np.pad(ann, ((0, ph), (0, pw)), constant_values=IGNORE)
            y = random.randint(0, img.shape[0] - self.crop)
            x = random.randint(0, img.shape[1] - self.crop)
            img = img[y:y + self.crop, x:x + self.crop]
            ann = ann[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, ann = img[:, ::-1], ann[:, ::-1]
            return to_tensor(img), torch.from_numpy(np.ascontiguousarray(ann)).long()
        # eval: short side 512, keep aspect
        w, h = img.size
        scale = min(2048 / max(w, h), 512 / min(w, h))
        img = img.resize((int(w * scale + 0.5), int(h * scale + 0.5)), Image.BILINEAR)
        return to_tensor(img), torch.from_numpy(np.array(ann)).long()


def lr_at(cfg, it):
    if it < cfg.warmup_iters:
        return cfg.lr * (1e-6 + (1 - 1e-6) * it / cfg.warmup_iters)
    return cfg.lr * (1 - it / cfg.max_iters) ** 1.0


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, ann in loader:
        img, ann = img.to(device), ann.to(device)
        logits = model(pixel_values=img).logits
        logits = F.interpolate(logits, size=ann.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1)
        m = ann != IGNORE
        hist += torch.bincount(ann[m] * num_classes + pred[m],
                               minlength=num_classes ** 2).view(num_classes, num_classes)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    acc = hist.diag().sum() / hist.sum()
    model.train()
    return torch.nanmean(iou).item(), acc.item()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    writer = None
    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.work_dir, "tb"))

    train_ds = ADE20K(cfg.data_root, "train", cfg.crop_size, train=True)
    val_ds = ADE20K(cfg.data_root, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_part = Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_part, batch_size=1, num_workers=2)

    net = SegformerForSemanticSegmentation.from_pretrained(
        cfg.backbone, num_labels=cfg.num_classes, ignore_mismatched_sizes=True,
        semantic_loss_ignore_index=IGNORE)
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    head, body = [], []
    for n, p in net.named_parameters():
        (head if n.startswith("decode_head") else body).append(p)
    optim = torch.optim.AdamW([{"params": body, "lr_mult": 1.0},
                               {"params": head, "lr_mult": cfg.head_lr_mult}],
                              lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)

    it, epoch, best = 0, 0, 0.0
    t0 = time.time()
    model.train()
    while it < cfg.max_iters:
        sampler.set_epoch(epoch)
        for img, ann in train_loader:
            lr = lr_at(cfg, it)
            for g in optim.param_groups:
                g["lr"] = lr * g["lr_mult"]
            img, ann = img.to(device, non_blocking=True), ann.to(device, non_blocking=True)
            out = model(pixel_values=img, labels=ann)
            optim.zero_grad(set_to_none=True)
            out.loss.backward()
            optim.step()
            it += 1

            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", out.loss.item(), it)
                writer.add_scalar("train/lr", lr, it)
                print(f"it {it} loss {out.loss.item():.4f} lr {lr:.2e} {time.time() - t0:.1f}s", flush=True)
                t0 = time.time()

            if it % cfg.eval_interval == 0 or it == cfg.max_iters:
                miou, acc = evaluate(net, val_loader, cfg.num_classes, device)
                if rank == 0:
                    writer.add_scalar("val/mIoU", miou, it)
                    writer.add_scalar("val/aAcc", acc, it)
                    print(f"== it {it}: mIoU {100 * miou:.2f} aAcc {100 * acc:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "iter": it}, os.path.join(cfg.work_dir, "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "iter": it, "mIoU": miou},
                                   os.path.join(cfg.work_dir, "best_mIoU.pth"))
                dist.barrier()
            if it >= cfg.max_iters:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
