"""Continue SigLIP pretraining on scraped image-text pairs stored as parquet shards.

Sigmoid loss (Zhai et al. 2023): each rank scores its local images against the
texts of all ranks.

    torchrun --nproc_per_node=8 04_siglip_finetune_parquet.py \
        --train-glob '/mnt/data/pairs/train-*.parquet' --val-glob '/mnt/data/pairs/val-*.parquet'
"""
import argparse
import glob
import io
import math
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoProcessor, SiglipModel

MIN_SIDE = 64


class ParquetPairs(Dataset):
    def __init__(self, files):
        self.images, self.texts = [], []
        for f in sorted(files):
            tbl = pq.read_table(f, columns=["jpg", "caption"])
            self.images.extend(tbl.column("jpg").to_pylist())
            self.texts.extend(tbl.column("caption").to_pylist())

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, idx):
        try:
            img = Image.open(io.BytesIO(self.images[idx]))
            img = img.convert("RGB")
        except (UnidentifiedImageError, OSError):
            return None
        if min(img.size) < MIN_SIDE or not self.texts[idx]:
            return None
        return img, self.texts[idx]


def make_collate(processor, max_len):
    def collate(batch):
        batch = [b for b in batch if b is not None]
        images, texts = zip(*batch)
        enc = processor(images=list(images), text=list(texts), padding="max_length",
                        truncation=True, max_length=max_len, return_tensors="pt")
        return enc["pixel_values"], enc["input_ids"]
    return collate


def siglip_loss(img_emb, txt_emb, logit_scale, logit_bias, rank, world_size):
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt_emb), dim=0)
    logits = logit_scale.exp() * img_emb @ all_txt.t() + logit_bias
    n = img_emb.shape[0]
    labels = -torch.ones_like(logits)
    labels[:, rank * n:(rank + 1) * n].fill_diagonal_(1.0)
    return -F.logsigmoid(labels * logits).sum() / n


@torch.no_grad()
def evaluate(model, loader, rank, world_size):
    model.eval()
    tot = torch.zeros(2, device="cuda")
    for pixel_values, input_ids in loader:
        pixel_values = pixel_values.cuda(non_blocking=True)
        input_ids = input_ids.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(pixel_values=pixel_values, input_ids=input_ids)
            loss = siglip_loss(out.image_embeds, out.text_embeds, model.module.logit_scale,
                               model.module.logit_bias, rank, world_size)
        tot[0] += loss.float()
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-glob", required=True)
    ap.add_argument("--val-glob", required=True)
    ap.add_argument("--model", default="google/siglip-base-patch16-224")
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=500)
    ap.add_argument("--max-text-len", type=int, default=64)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="out/siglip_ft")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    processor = AutoProcessor.from_pretrained(args.model)
    model = SiglipModel.from_pretrained(args.model).cuda()
    model = DDP(model, device_ids=[local_rank])

    collate = make_collate(processor, args.max_text_len)
    train_ds = ParquetPairs(glob.glob(args.train_glob))
    val_ds = ParquetPairs(glob.glob(args.val_glob))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True,
                              drop_last=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=4, collate_fn=collate, drop_last=True)

    params_decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    params_other = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": params_decay, "weight_decay": args.wd},
                                   {"params": params_other, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    total = args.epochs * len(train_loader)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return 0.5 * (1.0 + math.cos(math.pi * (step - args.warmup_steps) / (total - args.warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for pixel_values, input_ids in train_loader:
            pixel_values = pixel_values.cuda(non_blocking=True)
            input_ids = input_ids.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(pixel_values=pixel_values, input_ids=input_ids)
                loss = siglip_loss(out.image_embeds, out.text_embeds, model.module.logit_scale,
                                   model.module.logit_bias, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                lt = loss.detach().float()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    ips = 50 * args.batch_size * world_size / (time.time() - tic)
                    print(f"ep {epoch} step {step}/{total} loss {lt.item():.4f} {ips:.0f} img/s")
                    writer.add_scalar("train/loss", lt.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                    writer.add_scalar("train/t", model.module.logit_scale.exp().item(), step)
                tic = time.time()

        val_loss = evaluate(model, val_loader, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f}")
            writer.add_scalar("val/loss", val_loss, step)
            model.module.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
            processor.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
