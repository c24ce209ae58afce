"""Intent classification on CLINC150 with bert-base, HF Accelerate.

The global batch is fixed in the config (64); the number of accumulation steps is derived
from the number of processes, so the optimisation is the same on 1, 2 or 8 GPUs.

    accelerate launch --config_file accel_4gpu.yaml 13_accelerate_clinc_intent_accum.py
    accelerate launch --num_processes 2 13_accelerate_clinc_intent_accum.py --per_device_bs 16
"""
import argparse
import math
import os

import evaluate
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-base-uncased")
    p.add_argument("--dataset", default="clinc_oos")
    p.add_argument("--subset", default="plus")
    p.add_argument("--global_bs", type=int, default=64)
    p.add_argument("--per_device_bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--output_dir", default="runs/clinc_bert")
    p.add_argument("--checkpoint_every", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    state = PartialState()
    per_step = args.per_device_bs * state.num_processes
    if args.global_bs % per_step != 0:
        raise ValueError(f"global_bs {args.global_bs} not divisible by {per_step}")
    accum = args.global_bs // per_step

    accelerator = Accelerator(gradient_accumulation_steps=accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.print(f"processes={accelerator.num_processes} per_device_bs={args.per_device_bs} "
                      f"accum={accum} -> global batch {args.global_bs}")

    # download + tokenise once on the main process, the others then hit the caches
    with accelerator.main_process_first():
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        raw = load_dataset(args.dataset, args.subset)
        ds = raw.map(lambda b: tokenizer(b["text"], truncation=True, max_length=64),
                     batched=True, remove_columns=["text"])
    num_labels = raw["train"].features["intent"].num_classes
    ds = ds.rename_column("intent", "labels")
    ds.set_format("torch")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_dl = DataLoader(ds["train"], batch_size=args.per_device_bs, shuffle=True, collate_fn=collator,
                          num_workers=2)
    eval_dl = DataLoader(ds["validation"], batch_size=64, shuffle=False, collate_fn=collator)

    with accelerator.main_process_first():
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # counted on the un-sharded loader: optimizer updates for the whole run, independent of #GPUs
    updates_per_epoch = math.ceil(len(train_dl) / (accum * accelerator.num_processes))
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * total_updates) * accelerator.num_processes,
        num_training_steps=total_updates * accelerator.num_processes,
    )
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    accelerator.init_trackers("clinc_intent", config=vars(args))
    metric = evaluate.load("accuracy")
    best_acc, update = 0.0, 0

    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                update += 1
                if update % 25 == 0:
                    loss = accelerator.reduce(out.loss.detach(), reduction="mean")
                    accelerator.log({"train/loss": loss.item(),
                                     "train/lr": scheduler.get_last_lr()[0]}, step=update)

        model.eval()
        for batch in eval_dl:
            with torch.no_grad():
                logits = model(**batch).logits
            preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
            metric.add_batch(predictions=preds, references=refs)
        acc = metric.compute()["accuracy"]
        accelerator.print(f"epoch {epoch} val acc {acc:.4f}")
        accelerator.log({"val/acc": acc}, step=update)

        if (epoch + 1) % args.checkpoint_every == 0:
            # save_state is collective-aware: every process must call it
            accelerator.save_state(os.path.join(args.output_dir, f"state_epoch{epoch}"))

        if acc > best_acc:
            best_acc = acc
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
