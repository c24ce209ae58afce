# SFT of Mistral-7B on a single 4xA6000 box.
# ZeRO-2 with optimizer state offloaded to CPU, 8-bit Adam to keep the host RAM footprint sane.
#
#   accelerate launch --num_processes 4 --mixed_precision bf16 04_ds_zero2_bnb.py \
#       --model mistralai/Mistral-7B-v0.1 --data data/sft.jsonl
import argparse
import logging
import math
import os

import bitsandbytes as bnb
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = get_logger(__name__)

IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", default="data/sft.jsonl")
    ap.add_argument("--output_dir", default="out/mistral-sft")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--ckpt_every", type=int, default=500)
    return ap.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000000,
    }


def build_dataset(path, tokenizer, max_len):
    raw = load_dataset("json", data_files=path, split="train")

    def encode(ex):
        prompt_ids = tokenizer(ex["prompt"], add_special_tokens=True)["input_ids"]
        resp_ids = tokenizer(ex["response"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + resp_ids)[:max_len]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + resp_ids)[:max_len]
        return {"input_ids": ids, "labels": labels}

    return raw.map(encode, remove_columns=raw.column_names, num_proc=8)


def make_collate(pad_id):
    def collate(features):
        n = max(len(f["input_ids"]) for f in features)
        n = (n + 7) // 8 * 8
        ids = torch.full((len(features), n), pad_id, dtype=torch.long)
        lab = torch.full((len(features), n), IGNORE_INDEX, dtype=torch.long)
        att = torch.zeros((len(features), n), dtype=torch.long)
        for i, f in enumerate(features):
            L = len(f["input_ids"])
            ids[i, :L] = torch.tensor(f["input_ids"])
            lab[i, :L] = torch.tensor(f["labels"])
            att[i, :L] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return collate


def main():
    args = parse_args()
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(args))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.grad_accum,
                              log_with="tensorboard", project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token

    with accelerator.main_process_first():
        train_ds = build_dataset(args.data, tokenizer, args.max_len)

    loader = DataLoader(train_ds, batch_size=args.micro_batch, shuffle=True,
                        collate_fn=make_collate(tokenizer.pad_token_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    optimizer = bnb.optim.AdamW8bit(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    updates_per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total_updates)

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.init_trackers("mistral-sft", config=vars(args))

    progress = tqdm(total=total_updates, disable=not accelerator.is_local_main_process)
    update = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                update += 1
                progress.update(1)
                loss = accelerator.gather(out.loss.detach()).mean().item()
                accelerator.log({"train/loss": loss, "train/lr": scheduler.get_last_lr()[0]}, step=update)
                if update % args.ckpt_every == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"state_{update}"))

        logger.info(f"epoch {epoch} finished ({update} updates)", main_process_only=True)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        os.path.join(args.output_dir, "final"),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
