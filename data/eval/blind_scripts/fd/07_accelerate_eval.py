#!/usr/bin/env python
"""Closed-book QA eval (TriviaQA / NQ-open) with HF Accelerate.

    accelerate launch --num_processes 8 --mixed_precision bf16 07_accelerate_eval.py \
        --model Qwen/Qwen2-7B --dataset trivia_qa --config rc.nocontext

The model is prepared by accelerate (DDP wrapper), so generation goes through
unwrap_model; predictions are padded across processes and gathered with
gather_for_metrics, which drops the samples duplicated to even out the last batch.
"""
import argparse
import json
import os
import re
import string

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", default="trivia_qa")
    p.add_argument("--config", default="rc.nocontext")
    p.add_argument("--split", default="validation")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--output_dir", default="results/triviaqa")
    p.add_argument("--report_to", default="wandb")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def normalize(s):
    s = s.lower()
    s = "".join(c for c in s if c not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def main():
    args = parse_args()
    accelerator = Accelerator(log_with=args.report_to if args.report_to != "none" else None)
    set_seed(args.seed)

    if args.report_to != "none":
        accelerator.init_trackers("closed-book-qa", config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    raw = load_dataset(args.dataset, args.config, split=args.split)
    if args.limit:
        raw = raw.select(range(args.limit))
    aliases = [ex["answer"]["normalized_aliases"] for ex in raw]

    def to_features(ex, idx):
        prompt = f"Answer the question in a few words.\nQuestion: {ex['question']}\nAnswer:"
        enc = tokenizer(prompt, truncation=True, max_length=256)
        enc["idx"] = idx
        return enc

    with accelerator.main_process_first():
        ds = raw.map(to_features, with_indices=True, remove_columns=raw.column_names,
                     desc="tokenizing")

    def collate(features):
        idx = torch.tensor([f.pop("idx") for f in features])
        batch = tokenizer.pad(features, return_tensors="pt")
        batch["idx"] = idx
        return batch

    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=False, collate_fn=collate)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.eval()
    model, loader = accelerator.prepare(model, loader)
    gen_model = accelerator.unwrap_model(model)

    all_idx, all_tokens = [], []
    for step, batch in enumerate(loader):
        idx = batch.pop("idx")
        with torch.no_grad():
            out = gen_model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = out[:, batch["input_ids"].shape[1]:]
        # ranks stop generating at different lengths: pad before gathering
        new_tokens = accelerator.pad_across_processes(new_tokens, dim=1,
                                                      pad_index=tokenizer.pad_token_id)
        idx, new_tokens = accelerator.gather_for_metrics((idx, new_tokens))
        all_idx.extend(idx.cpu().tolist())
        all_tokens.extend(new_tokens.cpu().tolist())
        if step % 20 == 0:
            logger.info(f"step {step}/{len(loader)}", main_process_only=True)

    if accelerator.is_main_process:
        texts = tokenizer.batch_decode(all_tokens, skip_special_tokens=True)
        records, correct = [], 0
        for i, t in zip(all_idx, texts):
            pred = t.split("\n")[0].strip()
            hit = normalize(pred) in set(aliases[i])
            correct += int(hit)
            records.append({"idx": i, "prediction": pred, "correct": hit})
        em = correct / len(records)
        logger.info(f"EM = {em:.4f} over {len(records)} questions (expected {len(raw)})")
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "predictions.jsonl"), "w") as f:
            for r in sorted(records, key=lambda r: r["idx"]):
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump({"exact_match": em, "n": len(records)}, f, indent=2)
        if args.report_to != "none":
            accelerator.log({"eval/exact_match": em})

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
