"""ViT -> GPT-2 VisionEncoderDecoder fine-tuning for radiology reports with Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        06_accelerate_vit_gpt2.py --data_csv data/cxr_reports.csv --output_dir out/vit_gpt2
"""
import argparse
import math
import os

import datasets
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from f1chexbert import F1CheXbert
from PIL import Image
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (AutoTokenizer, GPT2Config, GPT2LMHeadModel, ViTImageProcessor, ViTModel,
                          VisionEncoderDecoderModel, get_scheduler)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_csv", required=True)
    p.add_argument("--image_dir", default="data/images")
    p.add_argument("--output_dir", default="out/vit_gpt2")
    p.add_argument("--encoder", default="google/vit-base-patch16-224-in21k")
    p.add_argument("--decoder", default="healx/gpt-2-pubmed-medium")
    p.add_argument("--per_device_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--base_lr", type=float, default=5e-5, help="lr for a global batch of 64")
    p.add_argument("--num_epochs", type=int, default=10)
    p.add_argument("--max_target_length", type=int, default=128)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--with_tracking", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="wandb" if args.with_tracking else None)
    set_seed(args.seed)
    logger.info(accelerator.state, main_process_only=False)

    image_processor = ViTImageProcessor.from_pretrained(args.encoder)
    tokenizer = AutoTokenizer.from_pretrained(args.decoder)
    tokenizer.pad_token = tokenizer.eos_token

    encoder = ViTModel.from_pretrained(args.encoder, add_pooling_layer=False)
    dec_cfg = GPT2Config.from_pretrained(args.decoder, add_cross_attention=True, is_decoder=True)
    decoder = GPT2LMHeadModel.from_pretrained(args.decoder, config=dec_cfg)
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.decoder_start_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def tokenize(batch):
        enc = tokenizer([t + tokenizer.eos_token for t in batch["report"]],
                        max_length=args.max_target_length, truncation=True, padding="max_length")
        enc["labels"] = [[t if m == 1 else -100 for t, m in zip(ids, mask)]
                         for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        return enc

    with accelerator.main_process_first():
        raw = datasets.load_dataset("csv", data_files=args.data_csv, split="train")
        raw = raw.filter(lambda r: r["report"] is not None and len(r["report"]) > 20)
        # patient-level split: derived from the subject id, so it is identical on every process
        raw = raw.map(lambda r: {"fold": int(r["subject_id"]) % 20})
        splits = {"train": raw.filter(lambda r: r["fold"] >= 2),
                  "val": raw.filter(lambda r: r["fold"] < 2)}
        splits = {k: v.map(tokenize, batched=True, num_proc=4, desc=f"tokenize {k}")
                  for k, v in splits.items()}

    def collate(rows):
        imgs = [Image.open(os.path.join(args.image_dir, r["image_path"])).convert("RGB") for r in rows]
        pix = image_processor(images=imgs, return_tensors="pt").pixel_values
        return {"pixel_values": pix,
                "labels": torch.tensor([r["labels"] for r in rows])}

    train_dl = DataLoader(splits["train"], shuffle=True, collate_fn=collate,
                          batch_size=args.per_device_batch_size, num_workers=8, drop_last=True)
    val_dl = DataLoader(splits["val"], shuffle=False, collate_fn=collate,
                        batch_size=args.per_device_batch_size, num_workers=8)

    global_batch = args.per_device_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    lr = args.base_lr * global_batch / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / args.gradient_accumulation_steps)
    total_steps = steps_per_epoch * args.num_epochs
    scheduler = get_scheduler("cosine", optimizer,
                              num_warmup_steps=int(0.05 * total_steps) * accelerator.num_processes,
                              num_training_steps=total_steps * accelerator.num_processes)

    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, val_dl, scheduler)

    if args.with_tracking:
        accelerator.init_trackers("cxr-report-gen", config={**vars(args), "lr": lr, "global_batch": global_batch})
    scorer = F1CheXbert(device=accelerator.device) if accelerator.is_main_process else None

    best_f1 = -1.0
    progress = tqdm(range(total_steps), disable=not accelerator.is_local_main_process)
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                out = model(pixel_values=batch["pixel_values"], labels=batch["labels"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                if args.with_tracking and progress.n % 20 == 0:
                    accelerator.log({"train/loss": out.loss.item(), "lr": scheduler.get_last_lr()[0]},
                                    step=progress.n)

        model.eval()
        hyps, refs = [], []
        gen_model = accelerator.unwrap_model(model)
        for batch in val_dl:
            with torch.no_grad():
                gen = gen_model.generate(batch["pixel_values"], num_beams=args.num_beams,
                                         max_new_tokens=args.max_target_length, early_stopping=True)
            gen = accelerator.pad_across_processes(gen, dim=1, pad_index=tokenizer.pad_token_id)
            labels = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
            gen, labels = accelerator.gather_for_metrics((gen, labels))
            hyps += tokenizer.batch_decode(gen.cpu().numpy(), skip_special_tokens=True)
            refs += tokenizer.batch_decode(labels.cpu().numpy(), skip_special_tokens=True)

        if accelerator.is_main_process:
            _, _, rep14, rep5 = scorer(hyps=hyps, refs=refs)
            metrics = {"val/f1_micro_14": rep14["micro avg"]["f1-score"],
                       "val/f1_micro_5": rep5["micro avg"]["f1-score"],
                       "val/f1_macro_14": rep14["macro avg"]["f1-score"],
                       "val/n": len(hyps)}
            logger.info(f"epoch {epoch}: {metrics}")
            if args.with_tracking:
                accelerator.log(metrics, step=progress.n)
            improved = metrics["val/f1_micro_5"] > best_f1
            best_f1 = max(best_f1, metrics["val/f1_micro_5"])
        else:
            improved = False

        accelerator.save_state(os.path.join(args.output_dir, "last_state"))
        flag = torch.tensor([int(improved)], device=accelerator.device)
        flag = accelerator.reduce(flag, reduction="sum")
        accelerator.wait_for_everyone()
        if flag.item() > 0:
            accelerator.unwrap_model(model).save_pretrained(
                os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
