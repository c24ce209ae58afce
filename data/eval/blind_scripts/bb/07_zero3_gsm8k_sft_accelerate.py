"""SFT on GSM8K with DeepSpeed ZeRO-3 through Accelerate, with exact-match eval by generation.

configs/zero3.yaml:
    compute_environment: LOCAL_MACHINE
    distributed_type: DEEPSPEED
    deepspeed_config:
      gradient_accumulation_steps: 4
      gradient_clipping: 1.0
      offload_optimizer_device: none
      offload_param_device: none
      zero3_init_flag: true
      zero3_save_16bit_model: true
      zero_stage: 3
    mixed_precision: bf16
    num_machines: 1
    num_processes: 8

    accelerate launch --config_file configs/zero3.yaml 07_zero3_gsm8k_sft_accelerate.py --output_dir runs/gsm8k-7b
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
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = get_logger(__name__)

ANS_RE = re.compile(r"####\s*(-?[\d,\.]+)")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--eval_limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--report_to", default="wandb")
    return p.parse_args()


def extract_answer(text):
    m = ANS_RE.search(text)
    if m is None:
        return None
    return m.group(1).replace(",", "").rstrip(".")


def prompt_of(question):
    return f"Question: {question}\nAnswer:"


def main():
    args = parse_args()
    accelerator = Accelerator(log_with=args.report_to, project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("gsm8k-sft", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token if tok.pad_token is None else tok.pad_token

    def tokenize_train(ex):
        p = tok(prompt_of(ex["question"]), add_special_tokens=True)["input_ids"]
        a = tok(" " + ex["answer"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + a)[: args.max_len]
        return {"input_ids": ids, "labels": ([-100] * len(p) + a)[: args.max_len]}

    def tokenize_eval(ex):
        return {"input_ids": tok(prompt_of(ex["question"]), add_special_tokens=True)["input_ids"],
                "gold": extract_answer(ex["answer"])}

    raw = load_dataset("openai/gsm8k", "main")
    if args.eval_limit:
        raw["test"] = raw["test"].select(range(args.eval_limit))
    with accelerator.main_process_first():
        train_ds = raw["train"].map(tokenize_train, remove_columns=raw["train"].column_names)
        eval_ds = raw["test"].map(tokenize_eval, remove_columns=raw["test"].column_names)
    golds = eval_ds["gold"]
    eval_ds = eval_ds.add_column("idx", list(range(len(eval_ds)))).remove_columns(["gold"])

    def train_collate(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), tok.pad_token_id)
        lab = torch.full((len(batch), L), -100)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], lab[i, :n], att[i, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    def eval_collate(batch):
        # left padding for generation
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), tok.pad_token_id)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, L - n:], att[i, L - n:] = torch.tensor(b["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": att, "idx": torch.tensor([b["idx"] for b in batch])}

    train_dl = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, shuffle=True,
                          collate_fn=train_collate, num_workers=2)
    eval_dl = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, shuffle=False,
                         collate_fn=eval_collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    accum = accelerator.gradient_accumulation_steps
    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / accum)
    total_updates = updates_per_epoch * args.epochs
    # the DeepSpeed engine steps this scheduler once per optimizer update
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    def run_eval():
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.config.use_cache = True
        correct, seen = 0, 0
        for batch in eval_dl:
            with torch.no_grad():
                # every rank must take part in each generation step under ZeRO-3
                out = unwrapped.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                    synced_gpus=True,
                )
            gen = out[:, batch["input_ids"].shape[1]:]
            gen = accelerator.pad_across_processes(gen, dim=1, pad_index=tok.pad_token_id)
            gen, idx = accelerator.gather_for_metrics((gen, batch["idx"]))
            for text, i in zip(tok.batch_decode(gen, skip_special_tokens=True), idx.tolist()):
                pred = extract_answer(text)
                correct += int(pred is not None and pred == golds[i])
                seen += 1
        unwrapped.config.use_cache = False
        model.train()
        return correct / max(seen, 1), seen

    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 10 == 0:
                    avg = accelerator.reduce(running, reduction="mean").item() / (10 * accum)
                    accelerator.log({"train/loss": avg, "lr": scheduler.get_last_lr()[0]}, step=global_step)
                    logger.info(f"epoch {epoch} update {global_step}/{total_updates} loss {avg:.4f}")
                    running = 0.0

        acc, n = run_eval()
        accelerator.log({"eval/gsm8k_em": acc}, step=global_step)
        logger.info(f"epoch {epoch}: GSM8K exact match {acc:.4f} on {n} problems")

        accelerator.wait_for_everyone()
        save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
        state_dict = accelerator.get_state_dict(model)
        accelerator.unwrap_model(model).save_pretrained(
            save_dir,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=state_dict,
            safe_serialization=True,
        )
        if accelerator.is_main_process:
            tok.save_pretrained(save_dir)

    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
