"""
CLIP-style image-text contrastive training (ViT-B/16 image tower + DistilBERT text tower)
on a CSV of (image_path, caption) pairs.

torchrun --standalone --nproc_per_node=8 02_clip_contrastive.py --train-csv cc3m_train.csv --val-csv cc3m_val.csv
"""
import argparse
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from torchvision.models import ViT_B_16_Weights, vit_b_16
from transformers import AutoModel, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--text-model", default="distilbert-base-uncased")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 4096")
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/clip")
    p.add_argument("--compile", action="store_true")
    return p.parse_args()


class CaptionDataset(Dataset):
    def __init__(self, csv_path, tokenizer, train=True, max_len=64):
        self.df = pd.read_csv(csv_path)
        self.tok = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize((0.481, 0.458, 0.408), (0.269, 0.261, 0.276))
        if train:
            self.tf = transforms.Compose([
                transforms.RandomResizedCrop(224, scale=(0.9, 1.0)),
                transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([
                transforms.Resize(224), transforms.CenterCrop(224),
                transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = self.tf(Image.open(row["image_path"]).convert("RGB"))
        enc = self.tok(str(row["caption"]), padding="max_length", truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return img, enc["input_ids"][0], enc["attention_mask"][0]


class CLIP(nn.Module):
    def __init__(self, text_model, embed_dim):
        super().__init__()
        self.visual = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
        self.visual.heads = nn.Identity()
        self.text = AutoModel.from_pretrained(text_model)
        self.img_proj = nn.Linear(768, embed_dim, bias=False)
        self.txt_proj = nn.Linear(self.text.config.dim, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images, input_ids, attention_mask):
        img = self.img_proj(self.visual(images))
        txt = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        txt = self.txt_proj(txt)
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), self.logit_scale.exp().clamp(max=100)


def clip_loss(img, txt, scale):
    # gather features from every rank, keeping the autograd graph for the local slice
    all_img = torch.cat(dist_fn.all_gather(img), dim=0)
    all_txt = torch.cat(dist_fn.all_gather(txt), dim=0)
    offset = dist.get_rank() * img.size(0)
    labels = torch.arange(img.size(0), device=img.device) + offset
    logits_i = scale * img @ all_txt.t()
    logits_t = scale * txt @ all_img.t()
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


@torch.no_grad()
def retrieval_eval(model, loader, device):
    model.eval()
    img_feats, txt_feats = [], []
    for images, ids, mask in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i, t, _ = model(images.to(device), ids.to(device), mask.to(device))
        img_feats.append(i.float())
        txt_feats.append(t.float())
    img_feats = torch.cat(img_feats)
    txt_feats = torch.cat(txt_feats)
    # all ranks hold the same number of val pairs (val set trimmed below)
    gathered_i = [torch.empty_like(img_feats) for _ in range(dist.get_world_size())]
    gathered_t = [torch.empty_like(txt_feats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered_i, img_feats)
    dist.all_gather(gathered_t, txt_feats)
    img_feats, txt_feats = torch.cat(gathered_i), torch.cat(gathered_t)
    sims = img_feats @ txt_feats.t()
    gt = torch.arange(sims.size(0), device=device)
    r1_i2t = (sims.argmax(dim=1) == gt).float().mean().item()
    r1_t2i = (sims.argmax(dim=0) == gt).float().mean().item()
    model.train()
    return r1_i2t, r1_t2i


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    # rank 0 downloads the pretrained weights / tokenizer first, the others wait
    if rank != 0:
        dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(args.text_model)
    model = CLIP(args.text_model, args.embed_dim)
    if rank == 0:
        dist.barrier()

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = CaptionDataset(args.train_csv, tokenizer, train=True)
    val_full = CaptionDataset(args.val_csv, tokenizer, train=False)
    per_rank = len(val_full) // world
    val_ds = Subset(val_full, range(rank * per_rank, (rank + 1) * per_rank))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, shuffle=False, num_workers=args.workers)

    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])
    if args.compile:
        model = torch.compile(model)

    global_bs = args.batch_size * world
    base_lr = args.lr * global_bs / 4096
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=base_lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = args.epochs * len(train_loader)

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, ids, mask in train_loader:
            lr = cosine_lr(step, total_steps, args.warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images, ids, mask = images.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, ids, mask)
            loss = clip_loss(img.float(), txt.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1

            if step % 50 == 0:
                logged = loss.detach().clone()
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if rank == 0:
                    ips = 50 * global_bs / (time.time() - t0)
                    print(f"ep {epoch} it {step}/{total_steps} loss {logged.item():.4f} "
                          f"scale {scale.item():.1f} lr {lr:.2e} {ips:.0f} img/s", flush=True)
                    writer.add_scalar("train/loss", logged.item(), step)
                    writer.add_scalar("train/logit_scale", scale.item(), step)
                t0 = time.time()

        core = model.module if not args.compile else model._orig_mod.module
        r_i2t, r_t2i = retrieval_eval(core, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: R@1 i2t {r_i2t:.3f} t2i {r_t2i:.3f}", flush=True)
            writer.add_scalar("val/r1_i2t", r_i2t, epoch)
            writer.add_scalar("val/r1_t2i", r_t2i, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": core.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
