"""CLIP-style contrastive image-text pretraining on a CSV of (image path, caption) pairs.

Launch:
    torchrun --nnodes=1 --nproc_per_node=8 02_clip_gather_layer.py \
        --train-csv /data/cc3m/train.csv --val-csv /data/cc3m/val.csv --out /checkpoints/clip_vitb16
"""
import argparse
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vision", default="vit_base_patch16_224")
    ap.add_argument("--text", default="roberta-base")
    ap.add_argument("--embed-dim", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 4096")
    ap.add_argument("--wd", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--local-loss", action="store_true")
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class CsvCaptions(Dataset):
    def __init__(self, csv, transform, tokenizer, max_len=77):
        df = pd.read_csv(csv, sep="\t")
        self.paths = df["filepath"].tolist()
        self.captions = df["title"].astype(str).tolist()
        self.transform = transform
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        image = self.transform(Image.open(self.paths[i]).convert("RGB"))
        tok = self.tokenizer(self.captions[i], padding="max_length", truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        return image, tok["input_ids"][0], tok["attention_mask"][0]


class CLIP(nn.Module):
    def __init__(self, vision, text, embed_dim):
        super().__init__()
        self.visual = timm.create_model(vision, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text, add_pooling_layer=False)
        self.visual_proj = nn.Linear(self.visual.num_features, embed_dim, bias=False)
        self.text_proj = nn.Linear(self.text.config.hidden_size, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.visual_proj(self.visual(images)), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        h = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(self.text_proj(h[:, 0]), dim=-1)

    def forward(self, images, input_ids, attention_mask):
        return (self.encode_image(images), self.encode_text(input_ids, attention_mask),
                self.logit_scale.exp())


def clip_loss(img, txt, logit_scale, rank, world_size, local_loss):
    # differentiable all_gather: gradients flow back to the rank that produced each feature
    all_img = torch.cat(torch.distributed.nn.all_gather(img), dim=0)
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt), dim=0)
    if local_loss:
        logits_per_image = logit_scale * img @ all_txt.t()
        logits_per_text = logit_scale * txt @ all_img.t()
        labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    else:
        logits_per_image = logit_scale * all_img @ all_txt.t()
        logits_per_text = logits_per_image.t()
        labels = torch.arange(all_img.shape[0], device=img.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cosine_lr(optimizer, base_lr, warmup, total):
    def _step(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
    return _step


@torch.no_grad()
def retrieval_eval(model, loader, device):
    model.eval()
    img_feats, txt_feats = [], []
    for images, ids, mask in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img_feats.append(model.encode_image(images.to(device)).float())
            txt_feats.append(model.encode_text(ids.to(device), mask.to(device)).float())
    img_feats, txt_feats = torch.cat(img_feats), torch.cat(txt_feats)
    sims = img_feats @ txt_feats.t()
    gt = torch.arange(sims.shape[0], device=device)
    out = {}
    for k in (1, 5, 10):
        out[f"i2t_R@{k}"] = (sims.topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
        out[f"t2i_R@{k}"] = (sims.t().topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)

    tokenizer = AutoTokenizer.from_pretrained(args.text)
    model = CLIP(args.vision, args.text, args.embed_dim).to(device)
    cfg = model.visual.pretrained_cfg
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), transforms.Normalize(cfg["mean"], cfg["std"])])
    val_tf = transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(cfg["mean"], cfg["std"])])

    train_ds = CsvCaptions(args.train_csv, train_tf, tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in n or "bias" in n else decay).append(p)
    lr = args.lr * args.batch_size * world_size / 4096
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98), eps=1e-6)

    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, step = ckpt["epoch"], ckpt["step"]

    model = DDP(model, device_ids=[local_rank])
    total_steps = len(loader) * args.epochs
    schedule = cosine_lr(optimizer, lr, args.warmup, total_steps)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        for images, ids, mask in loader:
            cur_lr = schedule(step)
            images, ids, mask = images.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, scale = model(images, ids, mask)
            loss = clip_loss(img_f.float(), txt_f.float(), scale.float(), rank, world_size, args.local_loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if step % 100 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", reduced.item(), step)
                    writer.add_scalar("train/lr", cur_lr, step)
                    writer.add_scalar("train/logit_scale", scale.item(), step)
                    print(f"ep {epoch} step {step} loss {reduced.item():.4f} {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            val_ds = CsvCaptions(args.val_csv, val_tf, tokenizer)
            val_loader = DataLoader(val_ds, batch_size=256, num_workers=8)
            metrics = retrieval_eval(model.module, val_loader, device)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            print(f"epoch {epoch}: {metrics}", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1, "step": step}, os.path.join(args.out, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
