"""
Fine-tune TrOCR (ViT encoder + RoBERTa decoder) on receipt text-line crops
(SROIE + in-house scanned receipts), plain PyTorch DDP.

    torchrun --nproc_per_node=4 finetune_trocr.py --train-csv data/lines/train.csv --val-csv data/lines/val.csv
"""
import argparse
import os
import time

import editdistance
import pandas as pd
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--img-root", default="data/lines/crops")
    p.add_argument("--model", default="microsoft/trocr-base-printed")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--max-target-len", type=int, default=64)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="out/trocr_receipts")
    return p.parse_args()


class LineCrops(Dataset):
    def __init__(self, csv, img_root, processor, max_len):
        df = pd.read_csv(csv, keep_default_na=False)
        self.files = df["file"].tolist()
        self.texts = df["text"].astype(str).tolist()
        self.img_root = img_root
        self.processor = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_root, self.files[i])).convert("RGB")
        pixel_values = self.processor(images=img, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(self.texts[i], padding="max_length", truncation=True,
                                          max_length=self.max_len).input_ids
        pad = self.processor.tokenizer.pad_token_id
        labels = torch.tensor([t if t != pad else -100 for t in labels])
        return {"pixel_values": pixel_values, "labels": labels, "idx": i}


@torch.no_grad()
def evaluate(model, loader, processor, device, args):
    model.eval()
    gen = model.module if hasattr(model, "module") else model
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # exact, n, char edits, chars
    for batch in loader:
        pix = batch["pixel_values"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            ids = gen.generate(pix, max_new_tokens=args.max_target_len, num_beams=args.num_beams)
        preds = processor.batch_decode(ids, skip_special_tokens=True)
        gts = [loader.dataset.texts[i] for i in batch["idx"].tolist()]
        for p, g in zip(preds, gts):
            p, g = p.strip(), g.strip()
            stats[0] += float(p == g)
            stats[1] += 1
            stats[2] += editdistance.eval(p, g)
            stats[3] += max(len(g), 1)
    dist.all_reduce(stats)
    model.train()
    line_acc = (stats[0] / stats[1]).item()
    cer = (stats[2] / stats[3]).item()
    return line_acc, cer


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    model.to(device)

    train_ds = LineCrops(args.train_csv, args.img_root, processor, args.max_target_len)
    val_ds = LineCrops(args.val_csv, args.img_root, processor, args.max_target_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_cer = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            pix = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=pix, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        if rank == 0:
            line_acc, cer = evaluate(model, val_dl, processor, device, args)
            print(f"epoch {epoch}: line acc {line_acc:.4f} CER {cer:.4f} "
                  f"char acc {1 - cer:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if cer < best_cer:
                best_cer = cer
                model.module.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
