"""Fine-tune RoBERTa on AG News with periodic hard-example mining.

After every regular epoch the training set is re-scored, the top `--hard-frac`
highest-loss examples are collected and the model gets an extra pass over
them before evaluation.

accelerate launch --multi_gpu --num_processes 4 hard_mining_agnews_accelerate.py
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader, Subset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--output-dir", default="out/agnews_hem")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--hard-frac", type=float, default=0.1)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision="bf16", log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("agnews_hem", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("ag_news")

    def encode(batch):
        return tok(batch["text"], truncation=True, max_length=args.max_len)

    with accelerator.main_process_first():
        ds = raw.map(encode, batched=True, remove_columns=["text"])
        ds = ds.map(lambda ex, i: {"idx": i}, with_indices=True)
    ds = ds.rename_column("label", "labels")
    ds.set_format("torch", columns=["input_ids", "attention_mask", "labels", "idx"])
    train_ds, test_ds = ds["train"], ds["test"]

    collate = DataCollatorWithPadding(tok)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate, num_workers=4)
    score_loader = DataLoader(train_ds, batch_size=256, shuffle=False,
                              collate_fn=collate, num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=256, shuffle=False,
                             collate_fn=collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=4)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)

    # counted on the un-sharded loaders; the prepared scheduler steps once per process
    n_hard = int(len(train_ds) * args.hard_frac)
    steps_per_epoch = len(train_loader) + math.ceil(n_hard / args.batch_size)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(0.06 * steps_per_epoch * args.epochs),
        num_training_steps=steps_per_epoch * args.epochs)

    model, optimizer, train_loader, score_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, score_loader, test_loader, scheduler)

    def batch_inputs(batch):
        return {k: v for k, v in batch.items() if k not in ("idx",)}

    global_step = 0
    best_acc = 0.0
    for epoch in range(args.epochs):
        # regular epoch
        model.train()
        for batch in train_loader:
            out = model(**batch_inputs(batch))
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 100 == 0:
                accelerator.log({"train/loss": out.loss.item()}, step=global_step)

        # score the whole training set
        model.eval()
        all_loss, all_idx = [], []
        with torch.no_grad():
            for batch in score_loader:
                logits = model(**batch_inputs(batch)).logits
                loss = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
                loss, idx = accelerator.gather_for_metrics((loss, batch["idx"]))
                all_loss.append(loss.cpu())
                all_idx.append(idx.cpu())
        all_loss, all_idx = torch.cat(all_loss), torch.cat(all_idx)
        hard = all_idx[torch.topk(all_loss, n_hard).indices].tolist()
        accelerator.print(f"epoch {epoch}: mean loss {all_loss.mean():.4f}, "
                          f"hard-set mean {all_loss.topk(n_hard).values.mean():.4f}")

        # extra pass over the hard examples
        hard_loader = DataLoader(Subset(train_ds, hard), batch_size=args.batch_size,
                                 shuffle=True, collate_fn=collate, num_workers=4)
        model.train()
        for batch in hard_loader:
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            out = model(**batch_inputs(batch))
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1

        # evaluation
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for batch in test_loader:
                logits = model(**batch_inputs(batch)).logits
                preds, labels = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
                correct += (preds == labels).sum().item()
                total += labels.numel()
        acc = correct / total
        accelerator.print(f"epoch {epoch}: test acc {acc:.4f}")
        accelerator.log({"test/acc": acc, "epoch": epoch}, step=global_step)

        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if acc > best_acc:
            best_acc = acc
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tok.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
