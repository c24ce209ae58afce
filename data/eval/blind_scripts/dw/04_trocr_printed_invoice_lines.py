#!/usr/bin/env python3
# Copyright (c) Document Intelligence Platform team.
#
# TrOCR (printed) adaptation to scanned invoice line items: low-DPI fax scans, dot-matrix
# fonts, stamps over text. Line crops come from the layout detector's "text_line" class.
#
# Usage:
#   torchrun --nnodes=1 --nproc_per_node=4 04_trocr_printed_invoice_lines.py \
#       --train-csv /data/invoice_lines/train.csv --val-csv /data/invoice_lines/val.csv \
#       --image-root /data/invoice_lines/crops --out /data/runs/trocr_invoice
import argparse
import csv
import logging
import os
import random
from pathlib import Path

import editdistance
import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageFilter
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel
from transformers.optimization import get_polynomial_decay_schedule_with_warmup

LOG = logging.getLogger("trocr-invoice")


def build_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="microsoft/trocr-base-printed")
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--eval-bs", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--beams", type=int, default=3)
    ap.add_argument("--augment", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    return ap


class InvoiceLineCrops(Dataset):
    """CSV columns: crop_path,text,doc_id"""

    def __init__(self, csv_path, image_root, processor, max_len, augment=False):
        with open(csv_path, newline="", encoding="utf-8") as fh:
            self.rows = [r for r in csv.DictReader(fh) if r["text"].strip()]
        self.root = Path(image_root)
        self.processor = processor
        self.max_len = max_len
        self.augment = augment

    def __len__(self):
        return len(self.rows)

    def _degrade(self, img):
        if random.random() < 0.3:
            img = img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.3, 1.1)))
        if random.random() < 0.3:
            w, h = img.size
            scale = random.uniform(0.5, 0.9)
            img = img.resize((max(1, int(w * scale)), max(1, int(h * scale)))).resize((w, h))
        return img

    def __getitem__(self, i):
        row = self.rows[i]
        img = Image.open(self.root / row["crop_path"]).convert("RGB")
        if self.augment:
            img = self._degrade(img)
        pixel_values = self.processor(images=img, return_tensors="pt").pixel_values[0]
        tok = self.processor.tokenizer(row["text"], max_length=self.max_len, truncation=True,
                                       padding="max_length", return_tensors="pt")
        labels = tok.input_ids[0]
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": labels}


def seed_worker(worker_id):
    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


def validate(model, loader, processor, args, device):
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # char_err, chars, word_err, words
    with torch.no_grad():
        for batch in loader:
            gen = model.generate(batch["pixel_values"].to(device), max_new_tokens=args.max_len,
                                 num_beams=args.beams, early_stopping=True)
            hyps = processor.batch_decode(gen, skip_special_tokens=True)
            lab = batch["labels"].clone()
            lab[lab == -100] = processor.tokenizer.pad_token_id
            refs = processor.batch_decode(lab, skip_special_tokens=True)
            for h, r in zip(hyps, refs):
                stats[0] += editdistance.eval(h, r)
                stats[1] += len(r)
                stats[2] += editdistance.eval(h.split(), r.split())
                stats[3] += len(r.split())
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return {"cer": (stats[0] / stats[1].clamp(min=1)).item(), "wer": (stats[2] / stats[3].clamp(min=1)).item()}


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    torch.manual_seed(1234)
    random.seed(1234 + rank)

    processor = TrOCRProcessor.from_pretrained(args.base)
    model = VisionEncoderDecoderModel.from_pretrained(args.base)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank])

    train_set = InvoiceLineCrops(args.train_csv, args.image_root, processor, args.max_len, augment=args.augment)
    val_set = InvoiceLineCrops(args.val_csv, args.image_root, processor, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          worker_init_fn=seed_worker, pin_memory=True, drop_last=True)
    # strided, un-padded shard so every val line is scored exactly once
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    val_dl = DataLoader(val_shard, batch_size=args.eval_bs, num_workers=args.workers)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    steps = len(train_dl) * args.epochs
    sched = get_polynomial_decay_schedule_with_warmup(opt, args.warmup, steps, lr_end=1e-7)

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        LOG.info("train lines %d, val lines %d, world %d", len(train_set), len(val_set), world)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_dl):
            pv = batch["pixel_values"].to(device, non_blocking=True)
            lb = batch["labels"].to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pv, labels=lb).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                LOG.info("epoch %d it %d/%d loss %.4f lr %.2e", epoch, it, len(train_dl), loss.item(),
                         sched.get_last_lr()[0])

        scores = validate(model, val_dl, processor, args, device)
        if rank == 0:
            LOG.info("epoch %d  CER %.4f  WER %.4f", epoch, scores["cer"], scores["wer"])
            if scores["cer"] < best:
                best = scores["cer"]
                model.module.save_pretrained(out / "best")
                processor.save_pretrained(out / "best")
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, out / "last.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
