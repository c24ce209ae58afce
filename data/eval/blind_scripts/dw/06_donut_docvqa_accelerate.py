"""Donut DocVQA fine-tuning with Hugging Face Accelerate.

Prompt format: <s_docvqa><s_question>{q}</s_question><s_answer>{a}</s_answer>
Metric: ANLS (threshold 0.5) against all reference answers.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        06_donut_docvqa_accelerate.py --train_file data/docvqa/train.jsonl --val_file data/docvqa/val.jsonl
"""
import argparse
import json
import math
import os
import re

import Levenshtein
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logger = get_logger(__name__)

SPECIAL = ["<s_docvqa>", "<s_question>", "</s_question>", "<s_answer>", "</s_answer>"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_file", required=True)
    p.add_argument("--val_file", required=True)
    p.add_argument("--image_dir", default="data/docvqa/images")
    p.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    p.add_argument("--output_dir", default="runs/donut_docvqa")
    p.add_argument("--image_size", type=int, nargs=2, default=[2560, 1920])
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--train_batch_size", type=int, default=2)
    p.add_argument("--eval_batch_size", type=int, default=1)  # prompts differ in length
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--checkpoint_every", type=int, default=2000)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class DocVQAJsonl(Dataset):
    """Rows: {"image": "...png", "question": "...", "answers": ["...", ...]}"""

    def __init__(self, path, image_dir, processor, max_length, train):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_dir = image_dir
        self.processor = processor
        self.max_length = max_length
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        image = Image.open(os.path.join(self.image_dir, row["image"])).convert("RGB")
        pixel_values = self.processor(image, random_padding=self.train, return_tensors="pt").pixel_values[0]
        prompt = f"<s_docvqa><s_question>{row['question']}</s_question><s_answer>"
        if not self.train:
            return {"pixel_values": pixel_values, "prompt": prompt, "answers": row["answers"]}
        target = prompt + row["answers"][0] + "</s_answer>" + self.processor.tokenizer.eos_token
        ids = self.processor.tokenizer(target, add_special_tokens=False, max_length=self.max_length,
                                       padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        # do not train on the prompt part
        prompt_len = len(self.processor.tokenizer(prompt, add_special_tokens=False).input_ids)
        labels[: prompt_len - 1] = -100
        return {"pixel_values": pixel_values, "labels": labels}


def eval_collate(batch):
    return {
        "pixel_values": torch.stack([b["pixel_values"] for b in batch]),
        "prompts": [b["prompt"] for b in batch],
        "answers": [b["answers"] for b in batch],
    }


def anls(pred, answers, tau=0.5):
    best = 0.0
    p = pred.strip().lower()
    for a in answers:
        a = a.strip().lower()
        nl = Levenshtein.distance(p, a) / max(len(p), len(a), 1)
        best = max(best, 1 - nl if nl < tau else 0.0)
    return best


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb")
    set_seed(args.seed)
    accelerator.init_trackers("donut-docvqa", config=vars(args))

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.image_size[0], "width": args.image_size[1]}
    processor.tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids("<s_docvqa>")
    model.config.encoder.image_size = args.image_size

    train_ds = DocVQAJsonl(args.train_file, args.image_dir, processor, args.max_length, train=True)
    val_ds = DocVQAJsonl(args.val_file, args.image_dir, processor, args.max_length, train=False)
    train_dl = DataLoader(train_ds, batch_size=args.train_batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.eval_batch_size, shuffle=False, num_workers=4,
                        collate_fn=eval_collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    # len(train_dl) is already the per-process length after prepare(); the prepared scheduler
    # advances num_processes times per optimizer update, so its horizon is scaled to match
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=args.warmup_steps * accelerator.num_processes,
        num_training_steps=args.epochs * updates_per_epoch * accelerator.num_processes,
    )
    scheduler = accelerator.prepare(scheduler)

    start_epoch, global_step = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        global_step = int(re.search(r"step_(\d+)", args.resume_from).group(1))
        start_epoch = global_step // updates_per_epoch
        accelerator.print(f"resumed at step {global_step}, epoch {start_epoch}")

    best_anls = 0.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        if args.resume_from and epoch == start_epoch:
            done = (global_step % updates_per_epoch) * args.grad_accum
            epoch_dl = accelerator.skip_first_batches(train_dl, done)
        else:
            epoch_dl = train_dl
        for batch in epoch_dl:
            with accelerator.accumulate(model):
                loss = model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 50 == 0:
                    mean_loss = accelerator.gather(loss.detach()).mean().item()
                    accelerator.log({"train/loss": mean_loss, "lr": scheduler.get_last_lr()[0]}, step=global_step)
                if global_step % args.checkpoint_every == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{global_step}"))

        # ---- ANLS on the validation set ----
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        tok = processor.tokenizer
        preds, refs = [], []
        for batch in val_dl:
            prompt_ids = tok(batch["prompts"], add_special_tokens=False,
                             return_tensors="pt").input_ids.to(accelerator.device)
            with torch.no_grad():
                out = unwrapped.generate(batch["pixel_values"], decoder_input_ids=prompt_ids,
                                         max_length=args.max_length, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id, bad_words_ids=[[tok.unk_token_id]])
            texts = tok.batch_decode(out, skip_special_tokens=False)
            answers = []
            for t in texts:
                m = re.search(r"<s_answer>(.*?)(</s_answer>|</s>|$)", t)
                answers.append(m.group(1).replace(tok.pad_token, "").strip() if m else "")
            # strings are gathered as objects; the duplicated tail of the last batch is dropped
            preds.extend(accelerator.gather_for_metrics(answers))
            refs.extend(accelerator.gather_for_metrics(batch["answers"]))

        score = sum(anls(p, r) for p, r in zip(preds, refs)) / max(len(refs), 1)
        accelerator.log({"val/anls": score, "epoch": epoch}, step=global_step)
        accelerator.print(f"epoch {epoch}: ANLS {score:.4f} on {len(refs)} questions")
        if score > best_anls:
            best_anls = score
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                          save_function=accelerator.save)
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        accelerator.wait_for_everyone()

    accelerator.end_training()


if __name__ == "__main__":
    main()
