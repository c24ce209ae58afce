"""CLIP-style image-text pretraining (ViT-B/16 + DistilBERT) with a global
contrastive loss: embeddings are all-gathered across ranks so every image is
contrasted with the captions of the whole global batch.

torchrun --nproc_per_node=8 train_clip.py --train-csv data/cc3m_train.csv --val-csv data/cc3m_val.csv
"""
import argparse
import math
import os

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer


class ImageTextCSV(Dataset):
    def __init__(self, csv_path, tokenizer, transform, max_len=64):
        self.df = pd.read_csv(csv_path, sep="\t")
        self.tok = tokenizer
        self.tf = transform
        self.max_len = max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = self.tf(Image.open(row["filepath"]).convert("RGB"))
        enc = self.tok(str(row["title"]), padding="max_length", truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return img, enc["input_ids"][0], enc["attention_mask"][0]


class CLIP(nn.Module):
    def __init__(self, text_model, embed_dim=512):
        super().__init__()
        self.visual = timm.create_model("vit_base_patch16_224", pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text_model)
        self.img_proj = nn.Linear(self.visual.num_features, embed_dim, bias=False)
        self.txt_proj = nn.Linear(self.text.config.dim, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, input_ids, attention_mask):
        img = self.img_proj(self.visual(images))
        txt = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        txt = self.txt_proj(txt)
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), self.logit_scale.exp()


def gather_features(x):
    # differentiable gather: gradients flow back to the rank that produced each row
    return torch.cat(torch.distributed.nn.functional.all_gather(x), dim=0)


def clip_loss(img, txt, scale, rank):
    all_img = gather_features(img)
    all_txt = gather_features(txt)
    logits_i = scale * img @ all_txt.t()
    logits_t = scale * txt @ all_img.t()
    labels = torch.arange(img.size(0), device=img.device) + rank * img.size(0)
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


def cosine_lr(opt, base_lr, warmup, total):
    def fn(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)  # loss sum, in-batch i2t top1 hits, samples
    for images, ids, mask in loader:
        images, ids, mask = images.to(device), ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img, txt, scale = model(images, ids, mask)
        img, txt = img.float(), txt.float()
        logits = scale * img @ txt.t()
        labels = torch.arange(img.size(0), device=device)
        sums[0] += F.cross_entropy(logits, labels, reduction="sum")
        sums[1] += (logits.argmax(1) == labels).sum()
        sums[2] += img.size(0)
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--text-model", default="distilbert-base-uncased")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="checkpoints/clip_b16")
    p.add_argument("--resume", default=None)
    p.add_argument("--wandb-project", default="clip-cc3m")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.text_model)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = ImageTextCSV(args.train_csv, tokenizer, train_tf)
    val_ds = ImageTextCSV(args.val_csv, tokenizer, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shard without padding so every val pair is counted exactly once
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = CLIP(args.text_model).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_wd = lambda n, p: p.ndim < 2 or "logit_scale" in n or "norm" in n or "bias" in n
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in params if not no_wd(n, p)], "weight_decay": args.wd},
        {"params": [p for n, p in params if no_wd(n, p)], "weight_decay": 0.0},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = args.epochs * len(train_loader)
    sched = cosine_lr(opt, args.lr, args.warmup, total_steps)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for images, ids, mask in train_loader:
            images = images.to(device, non_blocking=True)
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, ids, mask)
            loss = clip_loss(img.float(), txt.float(), scale.float(), rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/scale": scale.item(),
                               "lr": sched.get_last_lr()[0]}, step=step)

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} in-batch i2t@1 {val_acc:.3f}")
            wandb.log({"val/loss": val_loss, "val/i2t_top1": val_acc}, step=step)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
