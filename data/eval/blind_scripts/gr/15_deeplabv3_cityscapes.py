"""
Semantic segmentation on Cityscapes (19 train classes) with torchvision DeepLabV3-ResNet50.

DDP training, 8 GPUs, 768x768 random crops:
    torchrun --nproc_per_node=8 15_deeplabv3_cityscapes.py --root /data/cityscapes --iters 40000
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes
from torchvision.models import ResNet50_Weights
from torchvision.models.segmentation import deeplabv3_resnet50
from tqdm import tqdm

IGNORE = 255
NUM_CLASSES = 19
# Cityscapes label id -> train id
ID_TO_TRAINID = np.full(256, IGNORE, dtype=np.uint8)
for _id, _tid in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10,
                  24: 11, 25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():
    ID_TO_TRAINID[_id] = _tid
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--iters", type=int, default=40000)
    parser.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    parser.add_argument("--crop", type=int, default=768)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="work_dirs/deeplabv3_r50_cityscapes")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SegTransform:
    def __init__(self, crop, train):
        self.crop = crop
        self.train = train

    def __call__(self, image, target):
        target = Image.fromarray(ID_TO_TRAINID[np.array(target)])
        if self.train:
            scale = random.uniform(0.5, 2.0)
            w, h = image.size
            nw, nh = int(w * scale), int(h * scale)
            image = image.resize((nw, nh), Image.BILINEAR)
            target = target.resize((nw, nh), Image.NEAREST)
            pad_w, pad_h = max(self.crop - nw, 0), max(self.crop - nh, 0)
            if pad_w or pad_h:
                image = TF.pad(image, [0, 0, pad_w, pad_h], fill=0)
                target = TF.pad(target, [0, 0, pad_w, pad_h], fill=IGNORE)
            i = random.randint(0, image.size[1] - self.crop)
            j = random.randint(0, image.size[0] - self.crop)
            image = TF.crop(image, i, j, self.crop, self.crop)
            target = TF.crop(target, i, j, self.crop, self.crop)
            if random.random() < 0.5:
                image, target = TF.hflip(image), TF.hflip(target)
            image = TF.adjust_brightness(image, random.uniform(0.75, 1.25))
        image = TF.normalize(TF.to_tensor(image), MEAN, STD)
        return image, torch.from_numpy(np.array(target, dtype=np.int64))


def infinite_loader(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    for image, target in tqdm(loader, disable=not is_main_process(), desc="eval", leave=False):
        image, target = image.to(device), target.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(image)["out"]
        pred = logits.argmax(1)
        valid = target != IGNORE
        hist += torch.bincount(target[valid] * NUM_CLASSES + pred[valid],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


def main():
    args = parse_args()
    local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    world_size = dist.get_world_size()
    seed_everything(args.seed + dist.get_rank())

    train_set = Cityscapes(args.root, split="train", mode="fine", target_type="semantic",
                           transforms=SegTransform(args.crop, train=True))
    val_set = Cityscapes(args.root, split="val", mode="fine", target_type="semantic",
                         transforms=SegTransform(args.crop, train=False))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # 500 val images: 62 or 63 per rank with 8 GPUs, drop_last keeps shard sizes equal
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=args.workers)

    model = deeplabv3_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                               num_classes=NUM_CLASSES, aux_loss=True)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone_params = [p for n, p in model.named_parameters() if "backbone" in n]
    head_params = [p for n, p in model.named_parameters() if "backbone" not in n]
    optimizer = torch.optim.SGD([{"params": backbone_params, "lr": args.lr},
                                 {"params": head_params, "lr": args.lr * 10}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4)
    poly = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / args.iters) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    if is_main_process():
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {len(val_set)} val, global batch {args.batch_size * world_size}")

    batches = infinite_loader(train_loader, train_sampler)
    best_miou = 0.0
    model.train()
    t0 = time.time()
    pbar = tqdm(range(1, args.iters + 1), disable=not is_main_process())
    for it in pbar:
        image, target = next(batches)
        image = image.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(image)
            loss = criterion(out["out"], target) + 0.4 * criterion(out["aux"], target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        poly.step()

        if is_main_process() and it % 50 == 0:
            pbar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{poly.get_last_lr()[0]:.5f}")

        if it % args.eval_every == 0 or it == args.iters:
            miou, ious = evaluate(model, val_loader, device)
            if is_main_process():
                print(f"iter {it}: mIoU {miou:.4f} ({(time.time() - t0) / 60:.1f} min)", flush=True)
                torch.save({"model": model.module.state_dict(), "iter": it, "miou": miou},
                           os.path.join(args.out, "latest.pth"))
                if miou > best_miou:
                    best_miou = miou
                    torch.save({"model": model.module.state_dict(), "iter": it, "miou": miou},
                               os.path.join(args.out, "best.pth"))
            dist.barrier()

    cleanup()


if __name__ == "__main__":
    main()
