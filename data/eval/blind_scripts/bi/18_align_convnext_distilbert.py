"""ALIGN-style dual encoder: timm ConvNeXt-T image tower + DistilBERT text tower.

Pairs come from a directory of parquet files with `image_path` and `alt_text` columns
(alt-text crawl, lightly filtered). Zero-shot CIFAR-100 accuracy is reported every epoch.
"""
import argparse
import glob
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import CIFAR100
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parquet-dir", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--cifar-root", default="/data/cifar100")
    ap.add_argument("--image-model", default="convnext_tiny.fb_in22k")
    ap.add_argument("--text-model", default="distilbert-base-uncased")
    ap.add_argument("--dim", type=int, default=640)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="/shared/align_convnext")
    return ap.parse_args()


class AltTextPairs(Dataset):
    def __init__(self, parquet_dir, image_root, transform):
        frames = [pd.read_parquet(f, columns=["image_path", "alt_text"])
                  for f in sorted(glob.glob(os.path.join(parquet_dir, "*.parquet")))]
        df = pd.concat(frames, ignore_index=True)
        df = df[df["alt_text"].str.len().between(5, 300)]
        self.paths = df["image_path"].tolist()
        self.texts = df["alt_text"].tolist()
        self.image_root, self.transform = image_root, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_root, self.paths[i])).convert("RGB")
        return self.transform(img), self.texts[i]


class TokenizeCollate:
    def __init__(self, tokenizer, max_length=64):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch):
        imgs, texts = zip(*batch)
        tok = self.tokenizer(list(texts), padding="max_length", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        return torch.stack(imgs), tok.input_ids, tok.attention_mask


class Align(nn.Module):
    def __init__(self, image_model, text_model, dim):
        super().__init__()
        self.image_encoder = timm.create_model(image_model, pretrained=True, num_classes=dim)
        self.text_encoder = AutoModel.from_pretrained(text_model)
        self.text_head = nn.Linear(self.text_encoder.config.dim, dim)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def encode_image(self, x):
        return F.normalize(self.image_encoder(x), dim=-1)

    def encode_text(self, ids, mask):
        h = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return F.normalize(self.text_head(h), dim=-1)

    def forward(self, images, ids, mask):
        return self.encode_image(images), self.encode_text(ids, mask), self.temperature


def gather(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    parts[dist.get_rank()] = x
    return torch.cat(parts)


def align_loss(img, txt, temperature, smoothing):
    all_img, all_txt = gather(img), gather(txt)
    logits = all_img @ all_txt.t() / temperature
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels, label_smoothing=smoothing) +
            F.cross_entropy(logits.t(), labels, label_smoothing=smoothing)) / 2


@torch.no_grad()
def cifar_zeroshot(model, tokenizer, cifar, device):
    """Small enough to run on one GPU."""
    model.eval()
    prompts = [f"a photo of a {c.replace('_', ' ')}." for c in cifar.classes]
    tok = tokenizer(prompts, padding=True, return_tensors="pt").to(device)
    cls = model.encode_text(tok.input_ids, tok.attention_mask)
    loader = DataLoader(cifar, batch_size=500, num_workers=4)
    correct = 0
    for x, y in loader:
        pred = (model.encode_image(x.to(device)) @ cls.t()).argmax(1)
        correct += (pred.cpu() == y).sum().item()
    model.train()
    return correct / len(cifar)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    model = Align(args.image_model, args.text_model, args.dim)
    cfg = resolve_data_config({}, model=model.image_encoder)
    train_tf = create_transform(**cfg, is_training=True, auto_augment=None, re_prob=0.0)
    eval_tf = create_transform(**cfg, is_training=False)
    tokenizer = AutoTokenizer.from_pretrained(args.text_model)
    model = DDP(model.to(device), device_ids=[local_rank])

    dataset = AltTextPairs(args.parquet_dir, args.image_root, train_tf)

    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        collate_fn=TokenizeCollate(tokenizer), pin_memory=True, drop_last=True,
                        persistent_workers=True)
    cifar = CIFAR100(args.cifar_root, train=False, transform=eval_tf) if rank == 0 else None

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total,
                                                    pct_start=0.02, anneal_strategy="linear")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for it, (images, ids, mask) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, temperature = model(images, ids, mask)
            loss = align_loss(img.float(), txt.float(), temperature.float(), args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                model.module.temperature.clamp_(min=0.01)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"temp {temperature.item():.4f} {(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        if rank == 0:
            acc = cifar_zeroshot(model.module, tokenizer, cifar, device)
            print(f"epoch {epoch}: CIFAR-100 zero-shot top1 {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
