"""CLIP baseline in the style of the SLIP codebase (YFCC15M, ViT-S/16), our re-implementation.

    torchrun --nproc_per_node=8 16_slip_style_clip_yfcc.py --root /data/yfcc15m --output-dir ./out/clip_vits16
"""
import argparse
import json
import math
import os
import pickle
import random
import time
from collections import OrderedDict

import numpy as np
import timm
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torchvision import transforms

import open_clip


def get_args_parser():
    parser = argparse.ArgumentParser(description="CLIP pre-training", add_help=False)
    parser.add_argument("--root", default="/data/yfcc15m", type=str)
    parser.add_argument("--metadata", default="yfcc15m.pkl", type=str)
    parser.add_argument("--output-dir", default="./", type=str)
    parser.add_argument("--epochs", default=25, type=int)
    parser.add_argument("--warmup-epochs", default=1, type=int)
    parser.add_argument("--batch-size", default=64, type=int, help="per gpu")
    parser.add_argument("--lr", default=5e-4, type=float)
    parser.add_argument("--wd", default=0.5, type=float)
    parser.add_argument("--betas", default=(0.9, 0.98), nargs=2, type=float)
    parser.add_argument("--eps", default=1e-8, type=float)
    parser.add_argument("--print-freq", default=25, type=int)
    parser.add_argument("--workers", default=10, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--dist-backend", default="nccl", type=str)
    return parser


class YFCC15M(torch.utils.data.Dataset):
    def __init__(self, root, metadata, transform, tokenizer):
        with open(os.path.join(root, metadata), "rb") as f:
            self.samples = pickle.load(f)
        self.root = root
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        index, title, desc = self.samples[i]
        caption = np.random.choice([title, desc]) if desc else title
        img = Image.open(os.path.join(self.root, "images", index[:3], index[3:6], f"{index}.jpg")).convert("RGB")
        return self.transform(img), self.tokenizer(caption)[0]


class CLIP(nn.Module):
    def __init__(self, embed_dim=512, context_length=77, vocab_size=49408, width=512, layers=12, heads=8):
        super().__init__()
        self.visual = timm.create_model("vit_small_patch16_224", num_classes=0)
        self.image_projection = nn.Parameter(torch.empty(self.visual.num_features, embed_dim))
        self.text = open_clip.transformer.TextTransformer(context_length=context_length, vocab_size=vocab_size,
                                                          width=width, heads=heads, layers=layers,
                                                          output_dim=embed_dim)
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
        nn.init.normal_(self.image_projection, std=self.visual.num_features ** -0.5)

    def forward(self, image, text):
        image_embed = self.visual(image) @ self.image_projection
        text_embed = self.text(text)
        return {"image_embed": image_embed, "text_embed": text_embed, "logit_scale": self.logit_scale.exp()}


class CLIPLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.labels = None
        self.last_local_batch_size = None

    def forward(self, outputs):
        image_embed = F.normalize(outputs["image_embed"], dim=-1, p=2)
        text_embed = F.normalize(outputs["text_embed"], dim=-1, p=2)
        logit_scale = outputs["logit_scale"]
        local_batch_size = image_embed.size(0)
        rank, world = dist.get_rank(), dist.get_world_size()

        if local_batch_size != self.last_local_batch_size:
            self.labels = local_batch_size * rank + torch.arange(local_batch_size, device=image_embed.device)
            self.last_local_batch_size = local_batch_size

        image_all = [torch.zeros_like(image_embed) for _ in range(world)]
        text_all = [torch.zeros_like(text_embed) for _ in range(world)]
        dist.all_gather(image_all, image_embed)
        dist.all_gather(text_all, text_embed)
        image_all[rank], text_all[rank] = image_embed, text_embed
        image_all, text_all = torch.cat(image_all), torch.cat(text_all)

        logits_per_image = logit_scale * image_embed @ text_all.t()
        logits_per_text = logit_scale * text_embed @ image_all.t()
        loss = (F.cross_entropy(logits_per_image, self.labels) + F.cross_entropy(logits_per_text, self.labels)) / 2
        with torch.no_grad():
            acc = 100 * (logits_per_image.argmax(-1) == self.labels).float().mean()
        return {"loss": loss, "clip_loss": loss, "clip_acc": acc}


class AverageMeter:
    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def synchronize(self):
        t = torch.tensor([self.sum, self.count], dtype=torch.float64, device="cuda")
        dist.barrier()
        dist.all_reduce(t)
        self.sum, self.count = t.tolist()
        self.avg = self.sum / self.count


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup=0):
    warmup = np.linspace(start_warmup, base, warmup_epochs * niter_per_ep) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend=args.dist_backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model = CLIP().cuda(args.local_rank)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], bucket_cap_mb=200)
    criterion = CLIPLoss().cuda(args.local_rank)

    p_wd, p_non_wd = [], []
    for n, p in model.named_parameters():
        (p_non_wd if p.ndim < 2 or "bias" in n or "ln" in n or "bn" in n else p_wd).append(p)
    optimizer = torch.optim.AdamW([{"params": p_wd, "weight_decay": args.wd},
                                   {"params": p_non_wd, "weight_decay": 0}],
                                  lr=args.lr, betas=args.betas, eps=args.eps)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]

    cudnn.benchmark = True
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_transform = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                          transforms.ToTensor(), normalize])
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    train_dataset = YFCC15M(args.root, args.metadata, train_transform, tokenizer)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                               num_workers=args.workers, pin_memory=True, drop_last=True)
    lr_schedule = cosine_scheduler(args.lr, 1e-6, args.epochs, len(train_loader), warmup_epochs=args.warmup_epochs,
                                   start_warmup=1e-6)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        meters = OrderedDict((k, AverageMeter(k)) for k in ("loss", "clip_acc"))
        end = time.time()
        for data_iter, (images, texts) in enumerate(train_loader):
            it = len(train_loader) * epoch + data_iter
            for g in optimizer.param_groups:
                g["lr"] = lr_schedule[it]
            images = images.cuda(args.local_rank, non_blocking=True)
            texts = texts.cuda(args.local_rank, non_blocking=True)
            with torch.cuda.amp.autocast():
                outputs = model(images, texts)
                loss_dict = criterion(outputs)
                loss = loss_dict["loss"]
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"Loss is {loss.item()}, stopping training")
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            model.module.logit_scale.data.clamp_(0, 4.6052)
            for k in meters:
                meters[k].update(loss_dict[k].item(), args.batch_size)
            if data_iter % args.print_freq == 0 and rank == 0:
                print(f"Epoch [{epoch}][{data_iter}/{len(train_loader)}] "
                      + " ".join(f"{k} {m.val:.4f} ({m.avg:.4f})" for k, m in meters.items())
                      + f" time {time.time() - end:.3f}", flush=True)
            end = time.time()

        for m in meters.values():
            m.synchronize()
        if rank == 0:
            stats = {"epoch": epoch, **{f"train_{k}": m.avg for k, m in meters.items()}}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(stats) + "\n")
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "args": vars(args)},
                       os.path.join(args.output_dir, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("CLIP training", parents=[get_args_parser()])
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)
