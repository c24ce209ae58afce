"""LiT: locked-image text tuning.

The image tower is a frozen ImageNet-21k ViT-L/16 from timm; a text transformer is trained from
scratch to match it. Data: CSV with columns `image,caption` (paths relative to --root).
"""
import argparse
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
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from open_clip import get_tokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--image-model", default="vit_large_patch16_224.augreg_in21k")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context-length", type=int, default=77)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--logdir", default="runs/lit_vitl16")
    return p.parse_args()


class CsvPairs(Dataset):
    def __init__(self, csv_path, root, transform, tokenizer):
        df = pd.read_csv(csv_path)
        self.images = df["image"].tolist()
        self.captions = df["caption"].astype(str).tolist()
        self.root, self.transform, self.tokenizer = root, transform, tokenizer

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.images[i])).convert("RGB")
        return self.transform(img), self.tokenizer([self.captions[i]])[0]


class TextTower(nn.Module):
    def __init__(self, vocab_size, context_length, width, layers, heads, out_dim):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers)
        self.ln_final = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out_dim, bias=False)
        mask = torch.full((context_length, context_length), float("-inf")).triu(1)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        x = self.transformer(x, mask=self.attn_mask, is_causal=True)
        x = self.ln_final(x)
        # features at the EOT token (highest id in each row)
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]
        return self.proj(x)


class LiT(nn.Module):
    def __init__(self, image_model, text_tower):
        super().__init__()
        self.visual = image_model
        self.visual.requires_grad_(False)
        self.text = text_tower
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def train(self, mode=True):
        super().train(mode)
        self.visual.eval()  # locked tower stays in eval mode
        return self

    def forward(self, images, text):
        with torch.no_grad():
            img = self.visual(images)
        img = F.normalize(img.float(), dim=-1)
        txt = F.normalize(self.text(text).float(), dim=-1)
        return img, txt, self.logit_scale.exp()


def lit_loss(img, txt, scale):
    # gather the other ranks' embeddings; gradients flow through the local slice only
    rank, world = dist.get_rank(), dist.get_world_size()
    imgs = [torch.empty_like(img) for _ in range(world)]
    txts = [torch.empty_like(txt) for _ in range(world)]
    dist.all_gather(imgs, img.contiguous())
    dist.all_gather(txts, txt.contiguous())
    imgs[rank], txts[rank] = img, txt
    all_img, all_txt = torch.cat(imgs), torch.cat(txts)
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device)
    acc_sum = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for images, texts in loader:
        images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img, txt, scale = model(images, texts)
        logits = scale * img @ txt.t()
        labels = torch.arange(logits.shape[0], device=device)
        loss_sum += F.cross_entropy(logits, labels) * images.shape[0]
        acc_sum += (logits.argmax(1) == labels).float().sum()
        count += images.shape[0]
    for t in (loss_sum, acc_sum, count):
        dist.all_reduce(t)
    model.train()
    return (loss_sum / count).item(), (acc_sum / count).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42)

    image_model = timm.create_model(args.image_model, pretrained=True, num_classes=0)
    data_cfg = resolve_data_config({}, model=image_model)
    train_tf = create_transform(**data_cfg, is_training=True, scale=(0.5, 1.0), auto_augment=None)
    val_tf = create_transform(**data_cfg, is_training=False)
    tokenizer = get_tokenizer("ViT-B-32")
    text = TextTower(49408, args.context_length, args.width, args.layers, args.heads,
                     image_model.num_features)
    model = LiT(image_model, text).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = CsvPairs(args.train_csv, args.root, train_tf, tokenizer)
    val_set = CsvPairs(args.val_csv, args.root, val_tf, tokenizer)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader)
    warmup = int(args.warmup_epochs * steps_per_epoch)
    total = args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup:
            return args.lr * step / max(1, warmup)
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, texts in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, texts)
            loss = lit_loss(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/temperature", 1.0 / scale.item(), step)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], step)

        val_loss, val_acc = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} in-batch acc {val_acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("val/loss", val_loss, step)
            writer.add_scalar("val/in_batch_acc", val_acc, step)
            # only the text tower and the scale are trained; the image tower is the timm checkpoint
            state = {k: v for k, v in model.module.state_dict().items() if not k.startswith("visual.")}
            torch.save({"text_and_scale": state, "epoch": epoch, "args": vars(args)},
                       os.path.join(args.logdir, "lit_text.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
