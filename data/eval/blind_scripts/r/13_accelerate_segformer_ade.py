"""SegFormer-B2 fine-tuning on ADE20K-style folders with a custom Accelerate loop.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 13_accelerate_segformer_ade.py \
        --data /data/ADEChallengeData2016 --output runs/segformer_b2_ade
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import SegformerForSemanticSegmentation, get_polynomial_decay_schedule_with_warmup

NUM_LABELS = 150
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class ADE(Dataset):
    def __init__(self, root, split, crop=512, train=True):
        img_dir = os.path.join(root, "images", split)
        self.items = sorted(f[:-4] for f in os.listdir(img_dir) if f.endswith(".jpg"))
        self.img_dir, self.ann_dir = img_dir, os.path.join(root, "annotations", split)
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name = self.items[i]
        img = Image.open(os.path.join(self.img_dir, name + ".jpg")).convert("RGB")
        ann = Image.open(os.path.join(self.ann_dir, name + ".png"))
        if self.train:
            s = random.uniform(0.5, 2.0) * 512 / min(img.size)
            size = (int(img.width * s), int(img.height * s))
            img, ann = img.resize(size, Image.BILINEAR), ann.resize(size, Image.NEAREST)
        else:
            s = 512 / min(img.size)
            size = (int(img.width * s) // 32 * 32, int(img.height * s) // 32 * 32)
            img, ann = img.resize(size, Image.BILINEAR), ann.resize(size, Image.NEAREST)
        x = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        y = np.asarray(ann, dtype=np.int64) - 1  # 0 (other) -> -1 -> ignored
        y[y < 0] = 255
        if self.train:
            h, w = y.shape
            ph, pw = max(self.crop - h, 0), max(self.crop - w, 0)
            x = np.pad(x, ((0, ph), (0, pw), (0, 0)))
            y = np.pad(y, ((0, ph), (0, pw)), constant_values=255)
            h, w = y.shape
            top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x, y = x[top:top + self.crop, left:left + self.crop], y[top:top + self.crop, left:left + self.crop]
            if random.random() < 0.5:
                x, y = x[:, ::-1], y[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))), torch.from_numpy(np.ascontiguousarray(y))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ADEChallengeData2016")
    p.add_argument("--model", default="nvidia/mit-b2")
    p.add_argument("--output", default="runs/segformer_b2_ade")
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--lr", type=float, default=6e-5)
    p.add_argument("--max-steps", type=int, default=160000)
    p.add_argument("--warmup", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=8000)
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(accelerator, model, loader):
    model.eval()
    area_inter = torch.zeros(NUM_LABELS, device=accelerator.device, dtype=torch.float64)
    area_union = torch.zeros_like(area_inter)
    for x, y in loader:
        x, y = x.to(accelerator.device, non_blocking=True), y.to(accelerator.device, non_blocking=True)
        logits = model(pixel_values=x).logits
        logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1)
        valid = y != 255
        p, t = pred[valid], y[valid]
        inter = t[p == t]
        area_inter += torch.bincount(inter, minlength=NUM_LABELS).double()
        area_union += (torch.bincount(p, minlength=NUM_LABELS) + torch.bincount(t, minlength=NUM_LABELS)).double()
    area_union -= area_inter
    area_inter = accelerator.reduce(area_inter, reduction="sum")
    area_union = accelerator.reduce(area_union, reduction="sum")
    model.train()
    present = area_union > 0
    return (area_inter[present] / area_union[present]).mean().item()


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output)
    set_seed(args.seed)

    with accelerator.main_process_first():
        model = SegformerForSemanticSegmentation.from_pretrained(args.model, num_labels=NUM_LABELS,
                                                                 ignore_mismatched_sizes=True)
    if accelerator.num_processes > 1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    train_ds = ADE(args.data, "training", train=True)
    # val images keep their aspect ratio -> one image per batch, split evenly by hand
    val_full = ADE(args.data, "validation", train=False)
    val_ds = torch.utils.data.Subset(val_full, list(range(accelerator.process_index, len(val_full),
                                                          accelerator.num_processes)))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=6, drop_last=True,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, num_workers=2)

    head = [p for n, p in model.named_parameters() if n.startswith("decode_head")]
    body = [p for n, p in model.named_parameters() if not n.startswith("decode_head")]
    optimizer = torch.optim.AdamW([{"params": body, "lr": args.lr}, {"params": head, "lr": args.lr * 10}],
                                  lr=args.lr, weight_decay=0.01)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup * accelerator.num_processes,
                                                          args.max_steps * accelerator.num_processes, power=1.0)

    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    accelerator.init_trackers("segformer", config=vars(args))

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(os.path.basename(os.path.normpath(args.resume)).split("_")[-1])
    epoch_len = len(train_dl)
    active_dl = accelerator.skip_first_batches(train_dl, step % epoch_len) if step else train_dl
    bar = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_local_main_process)

    best = 0.0
    while step < args.max_steps:
        for x, y in active_dl:
            logits = model(pixel_values=x).logits
            logits = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
            loss = F.cross_entropy(logits, y, ignore_index=255)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            bar.update(1)
            if step % 50 == 0:
                accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item(),
                                 "lr": scheduler.get_last_lr()[0]}, step=step)
            if step % args.eval_every == 0 or step == args.max_steps:
                miou = evaluate(accelerator, model, val_dl)
                accelerator.log({"val/mIoU": miou}, step=step)
                accelerator.print(f"step {step}: mIoU {miou:.4f}")
                accelerator.save_state(os.path.join(args.output, f"step_{step}"))
                if miou > best:
                    best = miou
                    accelerator.wait_for_everyone()
                    accelerator.unwrap_model(model).save_pretrained(
                        os.path.join(args.output, "best"), is_main_process=accelerator.is_main_process,
                        save_function=accelerator.save)
            if step >= args.max_steps:
                break
        active_dl = train_dl

    accelerator.end_training()


if __name__ == "__main__":
    main()
