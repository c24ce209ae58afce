"""BART-base on XSum with HF Accelerate (no Trainer).

accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
    06_xsum_bart_accelerate.py --output_dir runs/xsum_bart_base --with_tracking
"""
import argparse
import json
import math
import os

import evaluate
import nltk
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_scheduler

logger = get_logger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name_or_path", default="facebook/bart-base")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_source_length", type=int, default=512)
    ap.add_argument("--max_target_length", type=int, default=64)
    ap.add_argument("--train_batch_size", type=int, default=16)
    ap.add_argument("--eval_batch_size", type=int, default=32)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    ap.add_argument("--learning_rate", type=float, default=5e-5)
    ap.add_argument("--num_train_epochs", type=int, default=4)
    ap.add_argument("--num_warmup_steps", type=int, default=1000)
    ap.add_argument("--num_beams", type=int, default=6)
    ap.add_argument("--checkpointing_steps", type=int, default=2000)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--with_tracking", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def postprocess_text(preds, labels):
    preds = ["\n".join(nltk.sent_tokenize(p.strip())) for p in preds]
    labels = ["\n".join(nltk.sent_tokenize(l.strip())) for l in labels]
    return preds, labels


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)

    def preprocess(batch):
        enc = tokenizer(batch["document"], max_length=args.max_source_length, truncation=True)
        enc["labels"] = tokenizer(text_target=batch["summary"], max_length=args.max_target_length,
                                  truncation=True)["input_ids"]
        return enc

    # main process writes the datasets cache, the others load it afterwards
    with accelerator.main_process_first():
        raw = load_dataset("EdinburghNLP/xsum")
        processed = raw.map(preprocess, batched=True, num_proc=8, remove_columns=raw["train"].column_names,
                            desc="Running tokenizer on dataset")

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    train_loader = DataLoader(processed["train"], shuffle=True, collate_fn=collator,
                              batch_size=args.train_batch_size, num_workers=4)
    eval_loader = DataLoader(processed["validation"], collate_fn=collator, batch_size=args.eval_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)

    # steps are counted on the per-process loader after prepare() shards it; the prepared
    # scheduler is stepped once per process on every optimizer step, hence the * num_processes
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_train_steps = steps_per_epoch * args.num_train_epochs
    lr_scheduler = get_scheduler("linear", optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers("xsum_bart", config={k: v for k, v in vars(args).items() if v is not None})

    rouge = evaluate.load("rouge")
    total_batch = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Num examples = {len(processed['train'])}, total batch = {total_batch}, steps = {max_train_steps}")

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        completed_steps = int(name.replace("step_", ""))
        starting_epoch = completed_steps // steps_per_epoch
        resume_step = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps

    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    progress.update(completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        if epoch == starting_epoch and resume_step:
            active_loader = accelerator.skip_first_batches(train_loader, resume_step)
        else:
            active_loader = train_loader
        for batch in active_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress.update(1)
                completed_steps += 1
                if completed_steps % args.checkpointing_steps == 0:
                    # every process takes part: save_state writes RNG states per process
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        # ---- evaluation: beam search on each shard, gathered for ROUGE ----
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        gen_kwargs = {"max_length": args.max_target_length, "num_beams": args.num_beams}
        for batch in tqdm(eval_loader, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                generated = unwrapped.generate(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **gen_kwargs
                )
            generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            generated, labels = accelerator.gather_for_metrics((generated, labels))
            labels = torch.where(labels != -100, labels, tokenizer.pad_token_id)
            preds = tokenizer.batch_decode(generated.cpu().numpy(), skip_special_tokens=True)
            refs = tokenizer.batch_decode(labels.cpu().numpy(), skip_special_tokens=True)
            preds, refs = postprocess_text(preds, refs)
            rouge.add_batch(predictions=preds, references=refs)
        result = rouge.compute(use_stemmer=True)
        result = {k: round(v * 100, 2) for k, v in result.items()}

        train_loss = accelerator.gather(total_loss.reshape(1)).mean().item()
        logger.info(f"epoch {epoch}: {result}")
        if args.with_tracking:
            accelerator.log({**result, "train_loss": train_loss / len(train_loader), "epoch": epoch},
                            step=completed_steps)

        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(os.path.join(args.output_dir, f"epoch_{epoch}"),
                                  is_main_process=accelerator.is_main_process, save_function=accelerator.save)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(os.path.join(args.output_dir, f"epoch_{epoch}"))
            with open(os.path.join(args.output_dir, f"epoch_{epoch}", "eval_results.json"), "w") as f:
                json.dump(result, f)

    accelerator.end_training()


if __name__ == "__main__":
    main()
