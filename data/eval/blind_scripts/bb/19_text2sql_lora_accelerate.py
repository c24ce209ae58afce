"""Text-to-SQL LoRA fine-tuning with Accelerate (multi-GPU DDP), with execution-free
exact-match evaluation by greedy generation after every epoch.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        19_text2sql_lora_accelerate.py --output_dir runs/sql-lora
"""
import argparse
import math
import os
import re

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

logger = get_logger(__name__)

TEMPLATE = "-- Schema:\n{context}\n-- Question: {question}\n-- SQL:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="deepseek-ai/deepseek-coder-1.3b-base")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_len", type=int, default=768)
    p.add_argument("--train_bsz", type=int, default=8)
    p.add_argument("--eval_bsz", type=int, default=32)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--n_eval", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def normalize_sql(s):
    s = s.strip().split(";")[0]
    s = re.sub(r"\s+", " ", s)
    s = re.sub(r"\s*([(),=<>])\s*", r"\1", s)
    return s.lower()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("text2sql", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token

    raw = load_dataset("b-mc2/sql-create-context", split="train").train_test_split(test_size=args.n_eval,
                                                                                   seed=args.seed)

    def enc_train(ex):
        prompt = TEMPLATE.format(context=ex["context"], question=ex["question"])
        p = tok(prompt, add_special_tokens=True)["input_ids"]
        a = tok(ex["answer"] + ";", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (p + a)[: args.max_len]
        return {"input_ids": ids, "labels": ([-100] * len(p) + a)[: args.max_len]}

    def enc_eval(ex):
        prompt = TEMPLATE.format(context=ex["context"], question=ex["question"])
        return {"input_ids": tok(prompt, add_special_tokens=True)["input_ids"][-args.max_len:],
                "gold": ex["answer"]}

    with accelerator.main_process_first():
        train_ds = raw["train"].map(enc_train, remove_columns=raw["train"].column_names, num_proc=8)
        eval_ds = raw["test"].map(enc_eval, remove_columns=raw["test"].column_names)

    def collate_train(b):
        L = max(len(x["input_ids"]) for x in b)
        ids = torch.full((len(b), L), tok.pad_token_id)
        lab = torch.full((len(b), L), -100)
        att = torch.zeros((len(b), L), dtype=torch.long)
        for i, x in enumerate(b):
            n = len(x["input_ids"])
            ids[i, :n], lab[i, :n], att[i, :n] = torch.tensor(x["input_ids"]), torch.tensor(x["labels"]), 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    def collate_eval(b):
        L = max(len(x["input_ids"]) for x in b)
        ids = torch.full((len(b), L), tok.pad_token_id)
        att = torch.zeros((len(b), L), dtype=torch.long)
        for i, x in enumerate(b):
            n = len(x["input_ids"])
            ids[i, L - n:], att[i, L - n:] = torch.tensor(x["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": att, "gold": [x["gold"] for x in b]}

    train_dl = DataLoader(train_ds, batch_size=args.train_bsz, shuffle=True, collate_fn=collate_train,
                          num_workers=4)
    eval_dl = DataLoader(eval_ds, batch_size=args.eval_bsz, shuffle=False, collate_fn=collate_eval)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    train_dl_len = math.ceil(len(train_dl) / accelerator.num_processes)
    max_steps = math.ceil(train_dl_len / args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * max_steps * accelerator.num_processes),
                                                max_steps * accelerator.num_processes)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                         scheduler)

    @torch.no_grad()
    def evaluate():
        model.eval()
        gen_model = accelerator.unwrap_model(model)
        n_correct, n_total = 0, 0
        for batch in eval_dl:
            out = gen_model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     max_new_tokens=128, do_sample=False, use_cache=True,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            preds = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            for pred, gold in zip(preds, batch["gold"]):
                n_correct += int(normalize_sql(pred) == normalize_sql(gold))
                n_total += 1
        model.train()
        return n_correct / max(1, n_total)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 20 == 0:
                    avg = accelerator.reduce(loss.detach(), reduction="mean")
                    accelerator.log({"train_loss": avg.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        em = evaluate()
        accelerator.log({"eval_exact_match": em}, step=step)
        logger.info(f"epoch {epoch}: exact match {em:.4f}")

        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, f"epoch_{epoch}"))
            tok.save_pretrained(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
