"""Contrastive fine-tuning of an OpenCLIP ViT-B/16 (LAION-2B init) on ROCO radiology
image-caption pairs, with zero-shot image->text retrieval on the ROCO test split.

    torchrun --standalone --nproc_per_node=4 13_openclip_roco_finetune.py \
        --train /data/roco/train.csv --test /data/roco/test.csv --out runs/roco_clip_b16
"""
import argparse
import math
import os
import time

import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="ViT-B-16")
    p.add_argument("--pretrained", default="laion2b_s34b_b88k")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--lock-image-layers", type=int, default=0, help="freeze the first N ViT blocks")
    return p.parse_args()


class CsvPairs(Dataset):
    def __init__(self, csv, transform, tokenizer):
        df = pd.read_csv(csv)
        self.paths, self.caps = df["image_path"].tolist(), df["caption"].astype(str).tolist()
        self.transform, self.tokenizer = transform, tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.transform(Image.open(self.paths[i]).convert("RGB"))
        return img, self.tokenizer([self.caps[i]])[0]


def contrastive_loss(img, txt, scale):
    all_img = torch.cat(torch.distributed.nn.all_gather(img), 0)
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt), 0)
    logits_per_image = scale * all_img @ all_txt.t()
    labels = torch.arange(all_img.size(0), device=img.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.t(), labels)) / 2


@torch.no_grad()
def evaluate(model, loader, device):
    """i2t / t2i recall@k on the whole test set (rank 0 only)."""
    model.eval()
    feats_i, feats_t = [], []
    for img, txt in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats_i.append(model.encode_image(img.to(device), normalize=True).float())
            feats_t.append(model.encode_text(txt.to(device), normalize=True).float())
    fi, ft = torch.cat(feats_i), torch.cat(feats_t)
    sim = fi @ ft.t()
    gt = torch.arange(len(fi), device=device)
    out = {}
    for k in (1, 5, 10):
        out[f"i2t@{k}"] = (sim.topk(k, 1).indices == gt[:, None]).any(1).float().mean().item() * 100
        out[f"t2i@{k}"] = (sim.t().topk(k, 1).indices == gt[:, None]).any(1).float().mean().item() * 100
    model.train()
    return out


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.arch, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.arch)
    if args.lock_image_layers > 0:
        for blk in model.visual.transformer.resblocks[: args.lock_image_layers]:
            blk.requires_grad_(False)
        model.visual.conv1.requires_grad_(False)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = CsvPairs(args.train, train_tf, tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(CsvPairs(args.test, val_tf, tokenizer), batch_size=256, num_workers=args.workers)

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gain_or_bias = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if gain_or_bias(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in named if not gain_or_bias(n, p)], "weight_decay": args.wd},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    best_r1 = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, txt in loader:
            img, txt = img.to(device, non_blocking=True), txt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = model(img, txt)
                loss = contrastive_loss(img_f, txt_f, scale)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/scale", scale.item(), step)
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()

        if rank == 0:
            res = evaluate(model.module, test_loader, device)
            print(f"epoch {epoch} {res}", flush=True)
            for k, v in res.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": opt.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if res["i2t@1"] > best_r1:
                best_r1 = res["i2t@1"]
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
