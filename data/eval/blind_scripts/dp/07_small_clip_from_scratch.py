"""Small CLIP (ViT-S/16 image tower, 6-layer text transformer) trained on CC3M.

Our own compact implementation, used for ablations before scaling up with open_clip.

    torchrun --nproc_per_node=8 07_small_clip_from_scratch.py --train-csv cc3m_train.csv \
        --val-csv cc3m_val.csv --out runs/s16_cc3m
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from open_clip import tokenize
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


class TextTransformer(nn.Module):
    def __init__(self, vocab_size=49408, width=384, layers=6, heads=6, context_length=77, embed_dim=256):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * width ** -0.5)
        mask = torch.full((context_length, context_length), float("-inf")).triu(1)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        x = self.transformer(x, mask=self.attn_mask)
        x = self.ln_final(x)
        # the end-of-text token has the largest id in every sequence
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]
        return x @ self.text_projection


class SmallCLIP(nn.Module):
    def __init__(self, embed_dim=256):
        super().__init__()
        self.visual = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=embed_dim)
        self.text = TextTransformer(embed_dim=embed_dim)
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def forward(self, image, text):
        img = F.normalize(self.visual(image), dim=-1)
        txt = F.normalize(self.text(text), dim=-1)
        return img, txt, self.logit_scale.exp()


class CC3M(Dataset):
    def __init__(self, csv, transform):
        df = pd.read_csv(csv, sep="\t")
        self.paths, self.caps = df["filepath"].tolist(), df["title"].tolist()
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(self.paths[i]).convert("RGB")), tokenize([self.caps[i]])[0]


def gather_features(x, rank, world_size):
    """all_gather has no backward; re-insert the local tensor so its gradient survives."""
    buf = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(buf, x)
    buf[rank] = x
    return torch.cat(buf)


def clip_loss(img, txt, scale, rank, world_size):
    all_img = gather_features(img, rank, world_size)
    all_txt = gather_features(txt, rank, world_size)
    logits_per_image = scale * img @ all_txt.t()
    logits_per_text = scale * txt @ all_img.t()
    labels = torch.arange(img.size(0), device=img.device) + rank * img.size(0)
    loss = F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)
    acc = (logits_per_image.argmax(-1) == labels).float().mean()
    return loss / 2, acc


@torch.no_grad()
def retrieval_eval(model, loader, device):
    model.eval()
    img_feats, txt_feats = [], []
    for images, texts in loader:
        i, t, _ = model(images.to(device), texts.to(device))
        img_feats.append(i)
        txt_feats.append(t)
    img_feats, txt_feats = torch.cat(img_feats), torch.cat(txt_feats)
    sim = img_feats @ txt_feats.t()
    gt = torch.arange(sim.size(0), device=device)
    res = {}
    for k in (1, 5, 10):
        res[f"i2t_R@{k}"] = (sim.topk(k, 1).indices == gt[:, None]).any(1).float().mean().item()
        res[f"t2i_R@{k}"] = (sim.t().topk(k, 1).indices == gt[:, None]).any(1).float().mean().item()
    model.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", default=None)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/s16_cc3m")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    model = SmallCLIP().to(device)
    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"]
    model = DDP(model, device_ids=[local_rank])

    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                          T.ToTensor(), T.Normalize(MEAN, STD)])
    val_tf = T.Compose([T.Resize(224, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                        T.ToTensor(), T.Normalize(MEAN, STD)])
    train_set = CC3M(args.train_csv, train_tf)
    sampler = DistributedSampler(train_set, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = None
    if rank == 0 and args.val_csv:
        val_loader = DataLoader(CC3M(args.val_csv, val_tf), batch_size=500, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98))
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        del ckpt
    total_steps = args.epochs * len(loader)
    warmup = args.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))))
    for _ in range(start_epoch * len(loader)):
        scheduler.step()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        tic = time.time()
        for it, (images, texts) in enumerate(loader):
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, texts)
            loss, acc = clip_loss(img.float(), txt.float(), scale, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            stats += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=device)])
            if it % 200 == 0 and rank == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.3f} acc {acc.item():.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - tic) / (it + 1):.3f}s/it", flush=True)

        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} mean loss {stats[0] / stats[2]:.4f} mean acc {stats[1] / stats[2]:.4f}")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1}, os.path.join(args.out, "checkpoint.pt"))
            if val_loader is not None:
                print(f"epoch {epoch} retrieval {retrieval_eval(model.module, val_loader, device)}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
