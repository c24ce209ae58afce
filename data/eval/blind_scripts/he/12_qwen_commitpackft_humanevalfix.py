"""Commit-message instruction tuning (CommitPackFT, Python subset) for Qwen2.5-Coder-0.5B,
evaluated on HumanEvalFix: the model gets a buggy function plus its tests and has to
return a fixed function; the fix is executed against the tests.

    accelerate launch --config_file configs/ddp_8gpu_bf16.yaml 12_qwen_commitpackft_humanevalfix.py \
        --with_tracking --resume_from_checkpoint latest
"""
import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = get_logger(__name__)
FMT = "<commit_before>\n{old}\n<commit_msg>\n{msg}\n<commit_after>\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B")
    p.add_argument("--dataset", default="bigcode/commitpackft")
    p.add_argument("--subset", default="python")
    p.add_argument("--fix_file", default="data/humanevalfix_python.jsonl")
    p.add_argument("--output_dir", default="out/qwen05-commitpackft")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--per_device_bs", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint_every", type=int, default=500)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--with_tracking", action="store_true")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def tokenize_fn(tok, max_len):
    def _fn(batch):
        out = {"input_ids": [], "labels": []}
        for old, msg, new in zip(batch["old_contents"], batch["message"], batch["new_contents"]):
            p = tok(FMT.format(old=old, msg=msg), add_special_tokens=False)["input_ids"]
            t = tok(new, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = (p + t)[:max_len]
            out["input_ids"].append(ids)
            out["labels"].append(([-100] * len(p) + t)[:max_len])
        return out
    return _fn


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, feats):
        L = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(feats), L), -100, dtype=torch.long)
        att = torch.zeros((len(feats), L), dtype=torch.long)
        for i, f in enumerate(feats):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            lab[i, :n] = torch.tensor(f["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}


def per_sequence_loss(logits, labels):
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    tok_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    n = (labels != -100).sum(1).clamp(min=1)
    return tok_loss.sum(1) / n


def execute(code, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "fix.py")
        with open(path, "w") as f:
            f.write(code)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humanevalfix(accelerator, model, tok, problems, args):
    model.eval()
    net = accelerator.unwrap_model(model)
    local = []
    with accelerator.split_between_processes(problems) as shard:
        for prob in shard:
            prompt = FMT.format(old=prob["declaration"] + prob["buggy_solution"] + "\n\n" + prob["test"],
                                msg=f"Fix bugs in {prob['entry_point']}.")
            enc = tok(prompt, return_tensors="pt").to(accelerator.device)
            out = net.generate(**enc, max_new_tokens=512, do_sample=False, pad_token_id=tok.pad_token_id)
            fixed = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            fixed = re.split(r"\n<commit_|\nif __name__", fixed)[0]
            program = fixed + "\n\n" + prob["test"] + "\n" + f"check({prob['entry_point']})\n"
            local.append((prob["task_id"], execute(program, args.timeout)))
    results = dict(gather_object(local))
    model.train()
    return sum(results.values()) / len(results)


def main():
    args = parse_args()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              log_with="wandb" if args.with_tracking else None, project_dir=args.output_dir)
    set_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    with accelerator.main_process_first():
        raw = load_dataset(args.dataset, args.subset, split="train")
        raw = raw.train_test_split(test_size=0.02, seed=args.seed)
        tokenized = raw.map(tokenize_fn(tok, args.max_len), batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names, desc="tokenizing")
    collate = Collator(tok.pad_token_id)
    train_dl = DataLoader(tokenized["train"], batch_size=args.per_device_bs, shuffle=True, collate_fn=collate,
                          num_workers=4)
    val_dl = DataLoader(tokenized["test"], batch_size=args.per_device_bs, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_updates) * accelerator.num_processes,
                                                total_updates * accelerator.num_processes)
    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, val_dl, scheduler)
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)

    if args.with_tracking:
        accelerator.init_trackers("commitpackft-qwen05", config=vars(args))

    with open(args.fix_file) as f:
        problems = [json.loads(l) for l in f]

    completed, start_epoch, resume_batches = 0, 0, 0
    if args.resume_from_checkpoint:
        ckpt_root = os.path.join(args.output_dir, "checkpoints")
        if args.resume_from_checkpoint == "latest":
            dirs = sorted((d for d in os.listdir(ckpt_root) if d.startswith("step_")),
                          key=lambda d: int(d.split("_")[1])) if os.path.isdir(ckpt_root) else []
            path = os.path.join(ckpt_root, dirs[-1]) if dirs else None
        else:
            path = args.resume_from_checkpoint
        if path:
            accelerator.load_state(path)
            completed = int(os.path.basename(path).split("_")[1])
            start_epoch = completed // updates_per_epoch
            resume_batches = (completed % updates_per_epoch) * args.grad_accum
            logger.info(f"resumed from {path} at update {completed}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        dl = train_dl
        if epoch == start_epoch and resume_batches:
            dl = accelerator.skip_first_batches(train_dl, resume_batches)
        for batch in dl:
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
            completed += 1
            if completed % 20 == 0 and args.with_tracking:
                accelerator.log({"train_loss": accelerator.reduce(loss.detach(), "mean").item(),
                                 "lr": scheduler.get_last_lr()[0]}, step=completed)
            if completed % args.checkpoint_every == 0:
                accelerator.save_state(os.path.join(args.output_dir, "checkpoints", f"step_{completed}"))

        model.eval()
        losses = []
        with torch.no_grad():
            for batch in val_dl:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                losses.append(accelerator.gather_for_metrics(per_sequence_loss(logits, batch["labels"])))
        val_loss = torch.cat(losses).mean().item()
        fix_rate = humanevalfix(accelerator, model, tok, problems, args)
        logger.info(f"epoch {epoch}: val_loss {val_loss:.4f} humanevalfix pass@1 {fix_rate:.4f}")
        if args.with_tracking:
            accelerator.log({"val_loss": val_loss, "humanevalfix/pass@1": fix_rate}, step=completed)

    accelerator.wait_for_everyone()
    final_dir = os.path.join(args.output_dir, "final")
    accelerator.unwrap_model(model).save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tok.save_pretrained(final_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
