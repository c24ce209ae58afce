"""
Multi-label image tagging (ASL loss, TResNet/ConvNeXt backbone) with HF Accelerate.
Validation mAP every epoch, with optional horizontal-flip TTA; best model by mAP.

    accelerate launch --num_processes 8 --mixed_precision fp16 14_accel_multilabel_tta_map.py \
        --train-ann ann/train.json --val-ann ann/val.json --img-root /data/tagging --wandb-project tagging
"""
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.nn as nn
import wandb
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from sklearn.metrics import average_precision_score
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-ann", required=True)
    p.add_argument("--val-ann", required=True)
    p.add_argument("--img-root", required=True)
    p.add_argument("--arch", default="convnext_small.fb_in22k")
    p.add_argument("--img-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--tta", action="store_true")
    p.add_argument("--output-dir", default="runs/tagging")
    p.add_argument("--wandb-project", default="tagging")
    p.add_argument("--run-name", default=None)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class TagDataset(Dataset):
    """ann json: {"tags": [...], "images": [{"file": ..., "tags": [...]}, ...]}"""

    def __init__(self, ann_path, img_root, tf):
        with open(ann_path) as f:
            ann = json.load(f)
        self.tags = ann["tags"]
        tag2id = {t: i for i, t in enumerate(self.tags)}
        self.items = [(im["file"], [tag2id[t] for t in im["tags"] if t in tag2id]) for im in ann["images"]]
        self.root, self.tf = img_root, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fn, tags = self.items[i]
        img = Image.open(os.path.join(self.root, fn)).convert("RGB")
        target = torch.zeros(len(self.tags))
        target[tags] = 1.0
        return self.tf(img), target


class AsymmetricLoss(nn.Module):
    def __init__(self, gamma_neg=4, gamma_pos=0, clip=0.05, eps=1e-8):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps = gamma_neg, gamma_pos, clip, eps

    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        p_neg = (1 - p + self.clip).clamp(max=1) if self.clip > 0 else 1 - p
        loss_pos = y * torch.log(p.clamp(min=self.eps)) * (1 - p) ** self.gamma_pos
        loss_neg = (1 - y) * torch.log(p_neg.clamp(min=self.eps)) * (1 - p_neg) ** self.gamma_neg
        return -(loss_pos + loss_neg).sum() / logits.size(0)


def mean_ap(scores, targets):
    aps = []
    for c in range(targets.shape[1]):
        if targets[:, c].sum() > 0:
            aps.append(average_precision_score(targets[:, c], scores[:, c]))
    return float(np.mean(aps)) * 100


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandAugment(num_ops=2, magnitude=9),
        transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize((args.img_size, args.img_size)), transforms.ToTensor(), norm])
    train_set = TagDataset(args.train_ann, args.img_root, train_tf)
    val_set = TagDataset(args.val_ann, args.img_root, val_tf)
    num_tags = len(train_set.tags)

    train_dl = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_set, batch_size=args.batch_size * 2, shuffle=False, num_workers=8, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=num_tags, drop_path_rate=0.2)
    criterion = AsymmetricLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                    total_steps=args.epochs * len(train_dl))

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        accelerator.print(f"{len(train_set)} train / {len(val_set)} val images, {num_tags} tags, "
                          f"{accelerator.num_processes} processes")

    best_map = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            with accelerator.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if step % 100 == 0 and accelerator.is_main_process:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                           "epoch": epoch + step / len(train_dl)})

        model.eval()
        all_scores, all_targets = [], []
        with torch.no_grad():
            for x, y in val_dl:
                with accelerator.autocast():
                    logits = model(x)
                    if args.tta:
                        logits = (logits + model(torch.flip(x, dims=[3]))) / 2
                scores = torch.sigmoid(logits.float())
                scores, y = accelerator.gather_for_metrics((scores, y))
                all_scores.append(scores.cpu())
                all_targets.append(y.cpu())
        all_scores = torch.cat(all_scores).numpy()
        all_targets = torch.cat(all_targets).numpy()
        val_map = mean_ap(all_scores, all_targets)

        accelerator.print(f"epoch {epoch}: val mAP {val_map:.2f} (n={len(all_scores)}) {time.time() - t0:.0f}s")
        if accelerator.is_main_process:
            wandb.log({"val/mAP": val_map, "epoch": epoch + 1})
            if val_map > best_map:
                best_map = val_map
                accelerator.save(accelerator.unwrap_model(model).state_dict(),
                                 os.path.join(args.output_dir, "best.pth"))
                wandb.run.summary["best_mAP"] = best_map
        accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "last.pth"))
        wandb.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
