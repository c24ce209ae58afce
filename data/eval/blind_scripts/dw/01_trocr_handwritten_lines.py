#!/usr/bin/env python
"""Fine-tune TrOCR on handwritten line crops exported from the claims-intake pipeline.

The line manifests are JSONL files with {"image": "<relative path>", "text": "<transcription>"}.
Run on one node:

    torchrun --nproc_per_node=8 01_trocr_handwritten_lines.py \
        --data-dir /mnt/shared/ocr/hw_lines --output-dir /mnt/shared/runs/trocr_hw
"""
import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import evaluate
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_linear_schedule_with_warmup

logger = logging.getLogger("trocr_hw")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--model-name", default="microsoft/trocr-base-handwritten")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--max-target-len", type=int, default=96)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class LineDataset(Dataset):
    def __init__(self, manifest, image_root, processor, max_target_len):
        with open(manifest, encoding="utf-8") as f:
            self.items = [json.loads(line) for line in f if line.strip()]
        self.image_root = Path(image_root)
        self.processor = processor
        self.max_target_len = max_target_len
        self.pad_id = processor.tokenizer.pad_token_id

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        image = Image.open(self.image_root / item["image"]).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values.squeeze(0)
        ids = self.processor.tokenizer(
            item["text"], padding="max_length", max_length=self.max_target_len, truncation=True
        ).input_ids
        labels = torch.tensor([t if t != self.pad_id else -100 for t in ids])
        return {"pixel_values": pixel_values, "labels": labels, "idx": idx}


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate_cer(model, loader, processor, device, args):
    """Generate on this rank's shard, then collect (idx, pred, ref) from every rank."""
    raw_model = model.module
    raw_model.eval()
    local = []
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        generated = raw_model.generate(
            pixel_values, max_new_tokens=args.max_target_len, num_beams=args.num_beams
        )
        preds = processor.batch_decode(generated, skip_special_tokens=True)
        labels = batch["labels"].clone()
        labels[labels == -100] = processor.tokenizer.pad_token_id
        refs = processor.batch_decode(labels, skip_special_tokens=True)
        local.extend(zip(batch["idx"].tolist(), preds, refs))

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    raw_model.train()
    if dist.get_rank() != 0:
        return None

    by_idx = {}
    for part in gathered:
        for idx, pred, ref in part:
            by_idx[idx] = (pred, ref)
    preds = [by_idx[i][0] for i in sorted(by_idx)]
    refs = [by_idx[i][1] for i in sorted(by_idx)]
    cer = evaluate.load("cer").compute(predictions=preds, references=refs)
    exact = sum(p.strip() == r.strip() for p, r in zip(preds, refs)) / max(len(refs), 1)
    return {"cer": cer, "line_exact": exact, "n": len(refs)}


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_cer):
    torch.save(
        {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_cer": best_cer,
        },
        path,
    )


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
    )
    torch.manual_seed(args.seed)

    processor = TrOCRProcessor.from_pretrained(args.model_name)
    model = VisionEncoderDecoderModel.from_pretrained(args.model_name)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.to(device)

    train_ds = LineDataset(args.data_dir / "train.jsonl", args.data_dir / "images", processor, args.max_target_len)
    val_ds = LineDataset(args.data_dir / "val.jsonl", args.data_dir / "images", processor, args.max_target_len)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True,
    )
    # un-padded strided shard for validation; duplicates are dropped by idx after the gather anyway
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight", "layernorm.weight")
    param_groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    start_epoch, best_cer = 0, math.inf
    if args.resume is not None and args.resume.exists():
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_cer = ckpt["epoch"] + 1, ckpt["best_cer"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(args.output_dir / "processor")
    dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pixel_values, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        metrics = evaluate_cer(model, val_loader, processor, device, args)
        if rank == 0:
            logger.info("epoch %d train_loss %.4f val %s (%.0fs)", epoch, train_loss, metrics, time.time() - t0)
            save_checkpoint(args.output_dir / "last.pt", model, optimizer, scheduler, epoch, best_cer)
            if metrics["cer"] < best_cer:
                best_cer = metrics["cer"]
                model.module.save_pretrained(args.output_dir / "best")
                with open(args.output_dir / "best_metrics.json", "w") as f:
                    json.dump({"epoch": epoch, **metrics}, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
