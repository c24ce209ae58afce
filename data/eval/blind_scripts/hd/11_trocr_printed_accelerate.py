"""Fine-tune TrOCR-small (printed) on invoice field crops with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        11_trocr_printed_accelerate.py --data-root /mnt/datasets/invoice_fields --output-dir /mnt/runs/trocr_inv
"""
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from jiwer import cer as jiwer_cer
from PIL import Image
from torch.utils.data import DataLoader
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_linear_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model-name", default="microsoft/trocr-small-printed")
    p.add_argument("--data-root", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--train-bs", type=int, default=32)
    p.add_argument("--eval-bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--checkpoint-every", type=int, default=2000)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("trocr-invoice", config=vars(args))

    processor = TrOCRProcessor.from_pretrained(args.model_name)
    model = VisionEncoderDecoderModel.from_pretrained(args.model_name)
    tok = processor.tokenizer
    model.config.decoder_start_token_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id

    # jsonl: {"image": "crops/000123.png", "text": "INV-2023-00981"}
    raw = load_dataset("json", data_files={"train": os.path.join(args.data_root, "train.jsonl"),
                                           "validation": os.path.join(args.data_root, "val.jsonl")})

    def transform(batch):
        images = [Image.open(os.path.join(args.data_root, p)).convert("RGB") for p in batch["image"]]
        pixel_values = processor(images=images, return_tensors="pt").pixel_values
        labels = tok(batch["text"], padding="max_length", truncation=True, max_length=args.max_len,
                     return_tensors="pt").input_ids
        labels[labels == tok.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": labels}

    train_ds = raw["train"].with_transform(transform)
    val_ds = raw["validation"].with_transform(transform)
    train_dl = DataLoader(train_ds, batch_size=args.train_bs, shuffle=True, num_workers=8, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.eval_bs, shuffle=False, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # dataloaders are sharded by prepare(), so count steps after it; the scheduler is stepped
    # by hand once per optimizer update (not through prepare)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    steps_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    max_steps = args.epochs * steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)
    accelerator.register_for_checkpointing(scheduler)

    start_epoch, skip_batches, global_step = 0, 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        global_step = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1])
        start_epoch = global_step // steps_per_epoch
        skip_batches = (global_step % steps_per_epoch) * args.grad_accum
        accelerator.print(f"resumed at step {global_step}, epoch {start_epoch}")

    best_cer = float("inf")
    for epoch in range(start_epoch, args.epochs):
        model.train()
        dl = accelerator.skip_first_batches(train_dl, skip_batches) if epoch == start_epoch and skip_batches else train_dl
        for batch in dl:
            with accelerator.accumulate(model):
                out = model(pixel_values=batch["pixel_values"], labels=batch["labels"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                scheduler.step()
                global_step += 1
                if global_step % 50 == 0:
                    loss = accelerator.gather(out.loss.detach()).mean().item()
                    accelerator.log({"train/loss": loss, "lr": scheduler.get_last_lr()[0]}, step=global_step)
                if global_step % args.checkpoint_every == 0:
                    # every process writes its own RNG / sampler state, main writes the weights
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{global_step}"))

        # ---- eval ----
        model.eval()
        preds, refs = [], []
        unwrapped = accelerator.unwrap_model(model)
        for batch in val_dl:
            with torch.no_grad():
                gen = unwrapped.generate(batch["pixel_values"], max_new_tokens=args.max_len, num_beams=1)
            gen = accelerator.pad_across_processes(gen, dim=1, pad_index=tok.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            gen, labels = accelerator.gather_for_metrics((gen, labels))
            labels = labels.masked_fill(labels == -100, tok.pad_token_id)
            preds += tok.batch_decode(gen, skip_special_tokens=True)
            refs += tok.batch_decode(labels, skip_special_tokens=True)
        val_cer = jiwer_cer(refs, preds)
        accelerator.log({"val/cer": val_cer, "epoch": epoch}, step=global_step)
        accelerator.print(f"epoch {epoch}: val CER {val_cer:.4f} on {len(refs)} lines")

        if val_cer < best_cer:
            best_cer = val_cer
            accelerator.wait_for_everyone()
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save,
                                      state_dict=accelerator.get_state_dict(model))
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best", "metrics.json"), "w") as f:
                    json.dump({"cer": val_cer, "epoch": epoch, "step": global_step}, f)

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
