"""Instruction-tune StarCoder2-3B on OSS-Instruct style data (problems seeded from
open-source repository snippets) with Hugging Face Accelerate.

Evaluates pass@1 on HumanEval+ style problems: every rank generates for its slice
of problems, runs the tests in a sandboxed subprocess, results are gathered on all ranks.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        05_starcoder2_accelerate_instruct.py --dataset data/oss_instruct_75k.jsonl
"""
import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, get_scheduler

logger = get_logger(__name__)

INSTRUCTION_FMT = "You are an exceptionally intelligent coding assistant.\n\n@@ Instruction\n{problem}\n\n@@ Response\n"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoder2-3b")
    p.add_argument("--dataset", required=True)
    p.add_argument("--eval_file", default="data/humanevalplus.jsonl")
    p.add_argument("--output_dir", default="output/sc2-3b-ossinstruct")
    p.add_argument("--max_length", type=int, default=1536)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup_steps", type=int, default=15)
    p.add_argument("--eval_steps", type=int, default=300)
    p.add_argument("--exec_timeout", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_features(tokenizer, max_length):
    def fn(ex):
        prompt = INSTRUCTION_FMT.format(problem=ex["problem"].strip())
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        resp_ids = tokenizer(ex["solution"].strip() + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + resp_ids)[:max_length]
        labels = ([-100] * len(prompt_ids) + resp_ids)[:max_length]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}
    return fn


def sandbox_run(program, timeout):
    with tempfile.TemporaryDirectory() as workdir:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write(program)
        try:
            out = subprocess.run([sys.executable, script], cwd=workdir, capture_output=True, timeout=timeout,
                                 env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0


def postprocess(completion):
    if "```python" in completion:
        completion = completion.split("```python", 1)[1].split("```", 1)[0]
    return completion


@torch.no_grad()
def evaluate(accelerator, model, tokenizer, problems, args):
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    per_task = []
    with accelerator.split_between_processes(problems) as mine:
        for prob in mine:
            prompt = INSTRUCTION_FMT.format(problem=prob["prompt"].strip()) + "```python\n"
            enc = tokenizer(prompt, return_tensors="pt").to(accelerator.device)
            gen = unwrapped.generate(**enc, max_new_tokens=512, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            code = postprocess("```python\n" + tokenizer.decode(gen[0, enc["input_ids"].shape[1]:],
                                                                skip_special_tokens=True))
            program = code + "\n\n" + prob["test"] + f"\n\ncheck({prob['entry_point']})\n"
            per_task.append((prob["task_id"], sandbox_run(program, args.exec_timeout)))
    everything = dict(gather_object(per_task))
    model.train()
    return sum(everything.values()) / len(everything)


def main():
    args = parse()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
    )
    model.config.use_cache = False

    raw = load_dataset("json", data_files=args.dataset, split="train")
    with accelerator.main_process_first():
        train_ds = raw.map(build_features(tokenizer, args.max_length), remove_columns=raw.column_names,
                           num_proc=8, desc="tokenize")
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.grad_accum)
    max_updates = updates_per_epoch * args.epochs
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=max_updates * accelerator.num_processes)

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.init_trackers("sc2_ossinstruct", config=vars(args))

    with open(args.eval_file) as f:
        problems = [json.loads(l) for l in f]

    update = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            update += 1
            if update % 10 == 0:
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.log({"train/loss": mean_loss, "lr": scheduler.get_last_lr()[0]}, step=update)
                logger.info(f"epoch {epoch} update {update}/{max_updates} loss {mean_loss:.4f}")
            if update % args.eval_steps == 0:
                score = evaluate(accelerator, model, tokenizer, problems, args)
                accelerator.log({"eval/pass@1": score}, step=update)
                logger.info(f"update {update}: pass@1 {score:.4f}")

        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.output_dir, f"state_epoch{epoch}"))

    score = evaluate(accelerator, model, tokenizer, problems, args)
    accelerator.log({"eval/pass@1": score}, step=update)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.output_dir, "final"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
