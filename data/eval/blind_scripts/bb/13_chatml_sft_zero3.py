"""Teach a base Llama-2 the ChatML format (new special tokens) with full fine-tuning on
DeepSpeed ZeRO-3 via Accelerate.

configs/ds_z3.yaml:
    distributed_type: DEEPSPEED
    deepspeed_config:
      zero_stage: 3
      zero3_init_flag: true
      zero3_save_16bit_model: true
      gradient_accumulation_steps: 8
      gradient_clipping: 1.0
      offload_optimizer_device: none
      offload_param_device: none
    mixed_precision: bf16
    num_processes: 8

    accelerate launch --config_file configs/ds_z3.yaml 13_chatml_sft_zero3.py --out runs/llama2-13b-chatml
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

logger = get_logger(__name__, log_level="INFO")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-13b-hf")
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bsz", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=0.03)
    ap.add_argument("--eval_samples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=os.path.join(args.out, "logs"))
    set_seed(args.seed)
    accelerator.init_trackers("chatml-sft")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")

    num_added = tokenizer.add_special_tokens(
        {"pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    if num_added > 0:
        model.resize_token_embeddings(len(tokenizer))
        # start the new rows at the mean of the existing embeddings instead of random init
        in_emb = model.get_input_embeddings().weight.data
        out_emb = model.get_output_embeddings().weight.data
        in_emb[-num_added:] = in_emb[:-num_added].mean(dim=0, keepdim=True)
        out_emb[-num_added:] = out_emb[:-num_added].mean(dim=0, keepdim=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def encode(ex):
        ids = tokenizer.apply_chat_template(ex["messages"], tokenize=True)[: args.max_len]
        # train on assistant turns only: mask everything up to and including each "<|im_start|>assistant\n"
        labels = [-100] * len(ids)
        in_assistant = False
        i = 0
        while i < len(ids):
            if ids[i] == im_start:
                header = tokenizer.decode(ids[i + 1:i + 3])
                in_assistant = header.startswith("assistant")
                j = i
                while j < len(ids) and tokenizer.decode(ids[j:j + 1]) != "\n":
                    j += 1
                i = j + 1
                continue
            if in_assistant:
                labels[i] = ids[i]
            i += 1
        return {"input_ids": ids, "labels": labels}

    with accelerator.main_process_first():
        raw = load_dataset(args.dataset)
        train_ds = raw["train_sft"].map(encode, remove_columns=raw["train_sft"].column_names, num_proc=32)
        eval_ds = raw["test_sft"].select(range(args.eval_samples)).map(
            encode, remove_columns=raw["test_sft"].column_names)

    def collate(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), tokenizer.pad_token_id)
        lab = torch.full((len(batch), L), -100)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for k, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[k, :n], lab[k, :n], att[k, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    train_dl = DataLoader(train_ds, batch_size=args.bsz, shuffle=True, collate_fn=collate, num_workers=4)
    eval_dl = DataLoader(eval_ds, batch_size=args.bsz, collate_fn=collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    accum = accelerator.gradient_accumulation_steps
    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / accum)
    max_updates = updates_per_epoch * args.epochs
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=int(args.warmup * max_updates),
                              num_training_steps=max_updates)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    progress = tqdm(total=max_updates, disable=not accelerator.is_local_main_process)
    update = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                update += 1
                progress.update(1)
                if update % 10 == 0:
                    loss = accelerator.reduce(out.loss.detach(), reduction="mean").item()
                    accelerator.log({"train_loss": loss, "lr": scheduler.get_last_lr()[0]}, step=update)

        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].size(0))))
        eval_loss = torch.cat(losses).mean().item()
        accelerator.log({"eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss)}, step=update)
        logger.info(f"epoch {epoch}: eval_loss={eval_loss:.4f}")

        accelerator.wait_for_everyone()
        save_dir = os.path.join(args.out, f"epoch-{epoch}")
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(save_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
        if accelerator.is_main_process:
            tokenizer.save_pretrained(save_dir)

    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
