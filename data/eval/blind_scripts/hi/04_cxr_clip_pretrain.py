#!/usr/bin/env python3
# Contrastive image-report pretraining (ConVIRT / CLIP style) on MIMIC-CXR.
# Image tower: ResNet-50, text tower: Bio_ClinicalBERT [CLS].
#
#   torchrun --nnodes=1 --nproc_per_node=8 04_cxr_clip_pretrain.py \
#       --csv /data/mimic/pretrain_pairs.csv --img-root /data/mimic/jpg --out /ckpt/cxrclip
import argparse
import glob
import logging
import os
import re

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger(__name__)


class PairDataset(Dataset):
    def __init__(self, csv, img_root, tokenizer, max_len=256, train=True):
        self.df = pd.read_csv(csv)
        self.df = self.df[self.df["split"] == ("train" if train else "validate")].reset_index(drop=True)
        self.img_root = img_root
        self.tokenizer = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        aug = [transforms.RandomResizedCrop(224, scale=(0.6, 1.0)), transforms.RandomRotation(10)] if train \
            else [transforms.Resize(256), transforms.CenterCrop(224)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        image = self.tf(Image.open(os.path.join(self.img_root, r.path)).convert("RGB"))
        text = re.sub(r"\s+", " ", f"{r.findings} {r.impression}").strip()
        tok = self.tokenizer(text, truncation=True, max_length=self.max_len, padding="max_length",
                             return_tensors="pt")
        return image, tok["input_ids"][0], tok["attention_mask"][0]


class CXRClip(nn.Module):
    def __init__(self, text_model, embed_dim=512):
        super().__init__()
        resnet = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        img_dim = resnet.fc.in_features
        resnet.fc = nn.Identity()
        self.image_encoder = resnet
        self.text_encoder = AutoModel.from_pretrained(text_model, add_pooling_layer=False)
        self.image_proj = nn.Sequential(nn.Linear(img_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, embed_dim))
        self.text_proj = nn.Sequential(nn.Linear(self.text_encoder.config.hidden_size, embed_dim), nn.ReLU(),
                                       nn.Linear(embed_dim, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # log(1/0.07)

    def forward(self, images, input_ids, attention_mask):
        img = self.image_proj(self.image_encoder(images))
        txt = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        txt = self.text_proj(txt)
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), self.logit_scale.exp().clamp(max=100)


def gather_with_grad_local(img, txt):
    """All-gather embeddings; only the local slice keeps its autograd graph (open_clip style)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    with torch.no_grad():
        imgs = [torch.zeros_like(img) for _ in range(world)]
        txts = [torch.zeros_like(txt) for _ in range(world)]
        dist.all_gather(imgs, img)
        dist.all_gather(txts, txt)
    imgs[rank] = img
    txts[rank] = txt
    return torch.cat(imgs), torch.cat(txts)


def clip_loss(img, txt, scale):
    all_img, all_txt = gather_with_grad_local(img, txt)
    n = img.size(0)
    offset = dist.get_rank() * n
    targets = torch.arange(offset, offset + n, device=img.device)
    logits_i2t = scale * img @ all_txt.t()
    logits_t2i = scale * txt @ all_img.t()
    return 0.5 * (F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets))


def latest_checkpoint(out_dir):
    files = sorted(glob.glob(os.path.join(out_dir, "ckpt_ep*.pt")))
    return files[-1] if files else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--img-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text-model", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.text_model)
    train_ds = PairDataset(args.csv, args.img_root, tokenizer, train=True)
    val_ds = PairDataset(args.csv, args.img_root, tokenizer, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers,
                            drop_last=True)

    model = CXRClip(args.text_model)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    resume_path = latest_checkpoint(args.out)
    if resume_path is not None:
        ckpt = torch.load(resume_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", resume_path, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (images, ids, mask) in enumerate(loader):
            images = images.cuda(non_blocking=True)
            ids = ids.cuda(non_blocking=True)
            mask = mask.cuda(non_blocking=True)
            with torch.cuda.amp.autocast():
                img, txt, scale = model(images, ids, mask)
                loss = clip_loss(img.float(), txt.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 50 == 0:
                logger.info("ep %d it %d/%d loss %.4f T=%.2f", epoch, it, len(loader), loss.item(),
                            1.0 / scale.item())

        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.cuda.amp.autocast():
            for images, ids, mask in val_loader:
                img, txt, scale = model(images.cuda(), ids.cuda(), mask.cuda())
                tot[0] += clip_loss(img.float(), txt.float(), scale.float())
                tot[1] += 1
        dist.all_reduce(tot)
        logger.info("epoch %d val contrastive loss %.4f", epoch, (tot[0] / tot[1]).item())

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"ckpt_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
