"""
Text-to-SQL fine-tune of Qwen2.5-Coder-1.5B with a custom accelerate loop and
generation-based exact-match eval on the dev split.

accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
    13_accelerate_text2sql.py --output_dir runs/t2sql --report_to wandb
"""
import argparse
import logging
import math
import os
import re

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

logger = get_logger(__name__)
TEMPLATE = "-- schema:\n{schema}\n-- question: {question}\n-- sql:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B")
    p.add_argument("--dataset", default="b-mc2/sql-create-context")
    p.add_argument("--output_dir", default="runs/t2sql")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=2e-5)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--max_len", type=int, default=768)
    p.add_argument("--eval_samples", type=int, default=2000)
    p.add_argument("--report_to", default="wandb")
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def norm_sql(s):
    s = s.strip().rstrip(";").lower()
    return re.sub(r"\s+", " ", s)


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with=args.report_to)
    set_seed(args.seed)
    accelerator.init_trackers("text2sql", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token

    def train_feats(ex):
        prompt = TEMPLATE.format(schema=ex["context"], question=ex["question"])
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(ex["answer"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + a)[: args.max_len]
        return {"input_ids": ids, "labels": ([-100] * len(p) + a)[: args.max_len]}

    def pad_train(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), tok.pad_token_id)
        lab = torch.full((len(batch), L), -100)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], lab[i, :n], att[i, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    def pad_eval(batch):
        prompts = [TEMPLATE.format(schema=b["context"], question=b["question"]) for b in batch]
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        enc["idx"] = torch.tensor([b["idx"] for b in batch])
        return enc

    with accelerator.main_process_first():
        raw = load_dataset(args.dataset, split="train").train_test_split(test_size=args.eval_samples,
                                                                         seed=0)
        train_ds = raw["train"].map(train_feats, remove_columns=raw["train"].column_names,
                                    num_proc=8)
        eval_ds = raw["test"].map(lambda ex, i: {"idx": i}, with_indices=True)
    gold = [norm_sql(a) for a in eval_ds["answer"]]

    train_dl = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, shuffle=True,
                          collate_fn=pad_train, num_workers=4)
    eval_dl = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, collate_fn=pad_eval)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    optim = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)

    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes
                                  / args.gradient_accumulation_steps)
    max_steps = updates_per_epoch * args.num_train_epochs
    sched = get_scheduler("cosine", optim,
                          num_warmup_steps=args.warmup_steps * accelerator.num_processes,
                          num_training_steps=max_steps * accelerator.num_processes)

    model, optim, train_dl, eval_dl, sched = accelerator.prepare(model, optim, train_dl,
                                                                 eval_dl, sched)

    progress = tqdm(range(max_steps), disable=not accelerator.is_local_main_process)
    step = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                progress.update(1)
                if step % 20 == 0:
                    mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                    accelerator.log({"train/loss": mean_loss,
                                     "train/lr": sched.get_last_lr()[0]}, step=step)

        # ---- generation eval: each rank decodes its share, results gathered on all ranks
        model.eval()
        gen_model = accelerator.unwrap_model(model)
        correct = 0
        seen = 0
        for batch in tqdm(eval_dl, disable=not accelerator.is_local_main_process, desc="eval"):
            idx = batch.pop("idx")
            with torch.no_grad():
                out = gen_model.generate(**batch, max_new_tokens=128, do_sample=False,
                                         pad_token_id=tok.pad_token_id)
            out = out[:, batch["input_ids"].shape[1]:]
            out = accelerator.pad_across_processes(out, dim=1, pad_index=tok.pad_token_id)
            out, idx = accelerator.gather_for_metrics((out, idx))
            preds = tok.batch_decode(out, skip_special_tokens=True)
            for p, i in zip(preds, idx.tolist()):
                correct += int(norm_sql(p.split("\n")[0]) == gold[i])
                seen += 1
        em = correct / max(seen, 1)
        accelerator.log({"eval/exact_match": em, "epoch": epoch}, step=step)
        logger.info(f"epoch {epoch}: exact match {em:.4f} on {seen} examples", main_process_only=True)

        accelerator.save_state(os.path.join(args.output_dir, f"state_epoch{epoch}"))

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tok.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
