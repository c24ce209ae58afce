"""Fine-tune TrOCR on handwritten line images (IAM / in-house forms).

    torchrun --nproc_per_node=8 03_trocr_handwritten.py \
        --train-csv data/hw/train.csv --val-csv data/hw/val.csv --image-dir data/hw/lines
"""
import argparse
import contextlib
import math
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
from transformers import (TrOCRProcessor, VisionEncoderDecoderModel,
                          get_cosine_schedule_with_warmup)


def parse_args():
    parser = argparse.ArgumentParser(description="TrOCR fine-tuning")
    parser.add_argument("--model", default="microsoft/trocr-base-handwritten")
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--val-csv", required=True)
    parser.add_argument("--image-dir", required=True)
    parser.add_argument("--output-dir", default="outputs/trocr-hw")
    parser.add_argument("--per-device-batch", type=int, default=12)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup-ratio", type=float, default=0.05)
    parser.add_argument("--max-target-len", type=int, default=128)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=6)
    return parser.parse_args()


class LineDataset(Dataset):
    def __init__(self, csv_path, image_dir, processor, max_target_len):
        self.df = pd.read_csv(csv_path, dtype={"file_name": str, "text": str}, keep_default_na=False)
        self.image_dir = image_dir
        self.processor = processor
        self.max_target_len = max_target_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        image = Image.open(os.path.join(self.image_dir, row.file_name)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values.squeeze(0)
        labels = self.processor.tokenizer(row.text, padding="max_length", truncation=True,
                                          max_length=self.max_target_len).input_ids
        labels = [t if t != self.processor.tokenizer.pad_token_id else -100 for t in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "idx": idx}


def init_distributed():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return local_rank, dist.get_rank(), dist.get_world_size()


def log(rank, msg):
    if rank == 0:
        print(time.strftime("%H:%M:%S"), msg, flush=True)


@torch.no_grad()
def run_eval(model, processor, loader, device, args):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        generated = model.generate(pixel_values, max_new_tokens=args.max_target_len, num_beams=args.num_beams,
                                   early_stopping=True)
        preds.extend(processor.batch_decode(generated, skip_special_tokens=True))
        label_ids = batch["labels"].clone()
        label_ids[label_ids == -100] = processor.tokenizer.pad_token_id
        refs.extend(processor.batch_decode(label_ids, skip_special_tokens=True))
    model.train()

    # character-level edits on this rank's shard, then summed across ranks
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for p, r in zip(preds, refs):
        stats[0] += editdistance.eval(p, r)
        stats[1] += max(len(r), 1)
        stats[2] += editdistance.eval(p.split(), r.split())
        stats[3] += max(len(r.split()), 1)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item(), preds[:3], refs[:3]


def main():
    args = parse_args()
    local_rank, rank, world_size = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    processor = TrOCRProcessor.from_pretrained(args.model)
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.to(device)
    # the ViT encoder pooler is never used by the decoder
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_ds = LineDataset(args.train_csv, args.image_dir, processor, args.max_target_len)
    val_ds = LineDataset(args.val_csv, args.image_dir, processor, args.max_target_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_shard = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.per_device_batch, shuffle=False,
                            num_workers=args.num_workers, pin_memory=True)

    no_decay = ("bias", "layer_norm.weight", "layernorm.weight", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    updates_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    log(rank, f"train={len(train_ds)} val={len(val_ds)} world={world_size} "
              f"global_batch={args.per_device_batch * world_size * args.grad_accum}")
    os.makedirs(args.output_dir, exist_ok=True)
    best_cer = 1.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            sync = (step + 1) % args.grad_accum == 0 or step + 1 == len(train_loader)
            with model.no_sync() if not sync else contextlib.nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(pixel_values=pixel_values, labels=labels).loss / args.grad_accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log(rank, f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item() * args.grad_accum:.4f}")

        if (epoch + 1) % args.eval_every == 0:
            cer, wer, ex_p, ex_r = run_eval(model, processor, val_loader, device, args)
            log(rank, f"epoch {epoch} val CER {cer:.4f} WER {wer:.4f} ({time.time() - t0:.0f}s)")
            for p, r in zip(ex_p, ex_r):
                log(rank, f"   pred: {p!r}\n    ref: {r!r}")
            if rank == 0 and cer < best_cer:
                best_cer = cer
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        processor.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
