"""Segmenter (ViT-S/16 encoder + mask transformer decoder) on PASCAL-Context 59.

    torchrun --nproc_per_node=8 12_pcontext_segmenter_vit.py --exp-name segmenter_vits_pc59
"""
import argparse
import math
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/VOCdevkit/VOC2010")
    ap.add_argument("--exp-name", default="segmenter_vits_pc59")
    ap.add_argument("--out-root", default="/checkpoints/segmenter")
    ap.add_argument("--num-classes", type=int, default=59)
    ap.add_argument("--crop", type=int, default=480)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--iters", type=int, default=80000)
    ap.add_argument("--eval-every", type=int, default=8000)
    ap.add_argument("--decoder-layers", type=int, default=2)
    ap.add_argument("--wandb-project", default="scene-seg")
    return ap.parse_args()


class PascalContext59(Dataset):
    def __init__(self, root, split, crop, train):
        with open(os.path.join(root, "ImageSets", "SegmentationContext", f"{split}.txt")) as f:
            self.ids = f.read().split()
        self.root, self.crop, self.train = root, crop, train
        self.mean = np.array([127.5, 127.5, 127.5], np.float32)
        self.std = np.array([127.5, 127.5, 127.5], np.float32)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(f"{self.root}/JPEGImages/{self.ids[i]}.jpg").convert("RGB")
        lbl = Image.open(f"{self.root}/SegmentationClassContext/{self.ids[i]}.png")
        w, h = img.size
        if self.train:
            ratio = random.uniform(0.5, 2.0)
            s = min(520 * ratio / max(w, h), 480 * ratio / min(w, h))
        else:
            s = min(520 / max(w, h), 480 / min(w, h))
        size = (int(w * s + 0.5), int(h * s + 0.5))
        img = np.asarray(img.resize(size, Image.BILINEAR), np.float32)
        lbl = np.asarray(lbl.resize(size, Image.NEAREST) if self.train else lbl, np.int64)
        lbl = lbl - 1
        lbl[lbl < 0] = IGNORE
        if self.train:
            ph, pw = max(self.crop - img.shape[0], 0), max(self.crop - img.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, img.shape[0] - self.crop), random.randint(0, img.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


class Segmenter(nn.Module):
    def __init__(self, n_cls, img_size=480, n_layers=2, d=384):
        super().__init__()
        self.encoder = timm.create_model("vit_small_patch16_384.augreg_in21k_ft_in1k", pretrained=True,
                                         img_size=img_size, num_classes=0, dynamic_img_size=True,
                                         drop_path_rate=0.1)
        self.patch = 16
        self.n_cls = n_cls
        self.cls_emb = nn.Parameter(torch.randn(1, n_cls, d) * 0.02)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 6, 4 * d, 0.0, batch_first=True, norm_first=True)
                                     for _ in range(n_layers)])
        self.proj_patch = nn.Parameter(d ** -0.5 * torch.randn(d, d))
        self.proj_classes = nn.Parameter(d ** -0.5 * torch.randn(d, d))
        self.dec_norm = nn.LayerNorm(d)
        self.mask_norm = nn.LayerNorm(n_cls)

    def forward(self, x):
        H, W = x.shape[-2:]
        ph, pw = math.ceil(H / self.patch) * self.patch - H, math.ceil(W / self.patch) * self.patch - W
        x = F.pad(x, (0, pw, 0, ph))
        tokens = self.encoder.forward_features(x)[:, self.encoder.num_prefix_tokens:]
        gh, gw = x.shape[-2] // self.patch, x.shape[-1] // self.patch
        z = torch.cat([tokens, self.cls_emb.expand(x.shape[0], -1, -1)], 1)
        for blk in self.blocks:
            z = blk(z)
        z = self.dec_norm(z)
        patches, cls = z[:, :-self.n_cls] @ self.proj_patch, z[:, -self.n_cls:] @ self.proj_classes
        patches, cls = F.normalize(patches, dim=-1), F.normalize(cls, dim=-1)
        masks = self.mask_norm(patches @ cls.transpose(1, 2))
        masks = masks.transpose(1, 2).reshape(x.shape[0], self.n_cls, gh, gw)
        masks = F.interpolate(masks, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return masks[..., :H, :W]


@torch.no_grad()
def evaluate(net, loader, n, device, win=480, stride=320):
    net.eval()
    hist = torch.zeros(n, n, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        _, _, H, W = img.shape
        acc = img.new_zeros(1, n, H, W)
        cnt = img.new_zeros(1, 1, H, W)
        for y in sorted({*range(0, max(H - win, 0), stride), max(H - win, 0)}):
            for x in sorted({*range(0, max(W - win, 0), stride), max(W - win, 0)}):
                acc[..., y:y + win, x:x + win] += net(img[..., y:y + win, x:x + win])
                cnt[..., y:y + win, x:x + win] += 1
        logits = F.interpolate(acc / cnt, size=lbl.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * n + pred[k], minlength=n * n).view(n, n)
    dist.all_reduce(hist)
    hist = hist.double()
    net.train()
    return torch.nanmean(hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    out_dir = os.path.join(args.out_root, args.exp_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    wandb.init(project=args.wandb_project, name=args.exp_name, config=vars(args))

    train_ds = PascalContext59(args.root, "train", args.crop, True)
    val_ds = PascalContext59(args.root, "val", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = Segmenter(args.num_classes, args.crop, args.decoder_layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=0.0)

    step, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            lr = args.lr * (1 - step / args.iters) ** 0.9
            for g in optimizer.param_groups:
                g["lr"] = lr
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": lr,
                           "train/it_per_s": 50 / (time.time() - t0)}, step=step)
                t0 = time.time()

            if step % args.eval_every == 0 or step == args.iters:
                miou = evaluate(net, val_loader, args.num_classes, device)
                wandb.log({"val/mIoU": miou}, step=step)
                if rank == 0:
                    print(f"step {step}: mIoU {100 * miou:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "step": step}, os.path.join(out_dir, "checkpoint.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "step": step, "miou": miou},
                                   os.path.join(out_dir, "best.pth"))
                dist.barrier()
            if step >= args.iters:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
