"""LMSYS - Chatbot Arena Human Preference Predictions.
Gemma-2 9B QLoRA sequence classifier (A wins / B wins / tie), single fold holdout.

accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 10_lmsys_gemma_qlora.py \
    --model google/gemma-2-9b-it --max-len 2048
"""
import argparse
import json
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training
from sklearn.metrics import log_loss
from torch.utils.data import DataLoader, Dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig,
                          get_cosine_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="google/gemma-2-9b-it")
    p.add_argument("--train", default="/data/lmsys/train_folds.parquet")
    p.add_argument("--out", default="./gemma9b_lora")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def parse_turns(s):
    try:
        return [t if t is not None else "" for t in json.loads(s)]
    except Exception:
        return [s]


def build_text(row):
    prompt, a, b = parse_turns(row.prompt), parse_turns(row.response_a), parse_turns(row.response_b)
    parts = []
    for p, ra, rb in zip(prompt, a, b):
        parts.append(f"<prompt>: {p}\n\n<response_a>: {ra}\n\n<response_b>: {rb}")
    return "\n\n".join(parts)


class PairDS(Dataset):
    def __init__(self, df, tok, max_len):
        self.texts = [build_text(r) for r in df.itertuples()]
        self.labels = np.argmax(df[["winner_model_a", "winner_model_b", "winner_tie"]].values, axis=1)
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": int(self.labels[i])}


def make_collate(tok):
    def collate(batch):
        m = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), m), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(batch), m), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            att[i, :n] = 1
        return {"input_ids": ids, "attention_mask": att, "labels": torch.tensor([b["labels"] for b in batch])}
    return collate


def evaluate(model, loader, accelerator):
    model.eval()
    probs, labels = [], []
    with torch.no_grad():
        for batch in loader:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            p, y = accelerator.gather_for_metrics((F.softmax(logits.float(), -1), batch["labels"]))
            probs.append(p.cpu().numpy())
            labels.append(y.cpu().numpy())
    model.train()
    probs, labels = np.concatenate(probs), np.concatenate(labels)
    return log_loss(labels, probs, labels=[0, 1, 2]), probs


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "right"
    tok.add_eos_token = True

    df = pd.read_parquet(args.train)
    trn, val = df[df.fold != args.fold].reset_index(drop=True), df[df.fold == args.fold].reset_index(drop=True)
    collate = make_collate(tok)
    train_dl = DataLoader(PairDS(trn, tok, args.max_len), batch_size=args.bs, shuffle=True, collate_fn=collate,
                          num_workers=2)
    valid_dl = DataLoader(PairDS(val, tok, args.max_len), batch_size=args.bs * 2, shuffle=False,
                          collate_fn=collate, num_workers=2)

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=3, quantization_config=bnb, torch_dtype=torch.bfloat16, device_map="auto")
    model.config.pad_token_id = tok.pad_token_id
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_r * 2, lora_dropout=0.05, task_type=TaskType.SEQ_CLS,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    model, opt, train_dl, valid_dl = accelerator.prepare(model, opt, train_dl, valid_dl)
    updates = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    # stepped by hand once per optimizer update, so it is not passed through prepare()
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * updates), updates)

    best, step = np.inf, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if accelerator.sync_gradients:
                    sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                loss = accelerator.gather(out.loss.detach()).mean().item()
                if accelerator.is_main_process and step % 20 == 0:
                    print(f"step {step}/{updates} loss {loss:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
                if step % args.eval_every == 0 or step == updates:
                    ll, probs = evaluate(model, valid_dl, accelerator)
                    accelerator.print(f"step {step} valid log_loss {ll:.4f}")
                    if ll < best:
                        best = ll
                        accelerator.wait_for_everyone()
                        unwrapped = accelerator.unwrap_model(model)
                        unwrapped.save_pretrained(os.path.join(args.out, "best"),
                                                  is_main_process=accelerator.is_main_process,
                                                  save_function=accelerator.save)
                        if accelerator.is_main_process:
                            oof = val[["id"]].copy()
                            oof[["winner_model_a", "winner_model_b", "winner_tie"]] = probs
                            oof.to_csv(os.path.join(args.out, f"oof_fold{args.fold}.csv"), index=False)

    accelerator.wait_for_everyone()
    accelerator.print(f"best valid log_loss {best:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
