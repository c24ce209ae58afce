"""Fine-tune TrOCR on handwritten text lines with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        06_trocr_finetune_accelerate.py --train-tsv data/iam_train.tsv --val-tsv data/iam_val.tsv

TSV: image_path <tab> transcription. Train/val come from the writer-disjoint Aachen split.
"""
import argparse
import logging
import math
import os

import jiwer
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/trocr-base-handwritten")
    ap.add_argument("--train-tsv", required=True)
    ap.add_argument("--val-tsv", required=True)
    ap.add_argument("--image-root", default=".")
    ap.add_argument("--out", default="runs/trocr-iam")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5, help="for the global batch above")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup-ratio", type=float, default=0.05)
    ap.add_argument("--max-target-len", type=int, default=128)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def read_tsv(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            img, text = line.rstrip("\n").split("\t", 1)
            rows.append((img, text))
    return rows


class LineOCRDataset(Dataset):
    def __init__(self, rows, root, processor, max_len):
        self.rows, self.root, self.processor, self.max_len = rows, root, processor, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        image = Image.open(os.path.join(self.root, path)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(text, padding="max_length", max_length=self.max_len,
                                          truncation=True).input_ids
        labels = [t if t != self.processor.tokenizer.pad_token_id else -100 for t in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "idx": i}


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.out)
    set_seed(args.seed)

    per_device = args.global_batch // (accelerator.num_processes * args.grad_accum)
    assert per_device * accelerator.num_processes * args.grad_accum == args.global_batch, \
        "global batch must divide num_processes * grad_accum"

    with accelerator.main_process_first():
        processor = TrOCRProcessor.from_pretrained(args.model)
        model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id

    train_ds = LineOCRDataset(read_tsv(args.train_tsv), args.image_root, processor, args.max_target_len)
    val_ds = LineOCRDataset(read_tsv(args.val_tsv), args.image_root, processor, args.max_target_len)
    val_texts = [t for _, t in val_ds.rows]
    # accelerator.prepare() shards these loaders across processes
    train_loader = DataLoader(train_ds, batch_size=per_device, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=per_device * 2, shuffle=False, num_workers=args.workers)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / args.grad_accum)
    total_updates = args.epochs * updates_per_epoch
    # the prepared scheduler is stepped once per process on every update, so count in those units
    scheduler = get_cosine_schedule_with_warmup(optimizer,
                                                int(args.warmup_ratio * total_updates) * accelerator.num_processes,
                                                total_updates * accelerator.num_processes)

    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)
    accelerator.init_trackers("trocr", config=vars(args))

    best_cer = float("inf")
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        pbar = tqdm(train_loader, disable=not accelerator.is_local_main_process, desc=f"epoch {epoch}")
        for batch in pbar:
            with accelerator.accumulate(model):
                out = model(pixel_values=batch["pixel_values"], labels=batch["labels"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 25 == 0:
                    loss = accelerator.reduce(out.loss.detach(), reduction="mean").item()
                    accelerator.log({"train/loss": loss, "train/lr": scheduler.get_last_lr()[0]}, step=global_step)
                    pbar.set_postfix(loss=f"{loss:.3f}")

        # generation runs on the unwrapped model; predictions are padded to a common length before gathering
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        preds, indices = [], []
        for batch in tqdm(val_loader, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                gen = unwrapped.generate(batch["pixel_values"], max_new_tokens=args.max_target_len,
                                         num_beams=args.num_beams)
            gen = accelerator.pad_across_processes(gen, dim=1, pad_index=processor.tokenizer.pad_token_id)
            gen, idx = accelerator.gather_for_metrics((gen, batch["idx"]))
            preds += processor.batch_decode(gen.cpu(), skip_special_tokens=True)
            indices += idx.cpu().tolist()
        refs = [val_texts[i] for i in indices]
        cer = jiwer.cer(refs, preds)
        wer = jiwer.wer(refs, preds)
        accelerator.log({"val/cer": cer, "val/wer": wer}, step=global_step)
        logger.info(f"epoch {epoch}: CER {cer:.4f} WER {wer:.4f}", main_process_only=True)

        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.out, "last_state"))
        if cer < best_cer:
            best_cer = cer
            unwrapped.save_pretrained(os.path.join(args.out, "best"), is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.out, "best"))

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
