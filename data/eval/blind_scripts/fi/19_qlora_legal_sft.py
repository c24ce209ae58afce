#!/usr/bin/env python
"""QLoRA SFT on clause-rewriting instructions for the legal drafting assistant.

    torchrun --nproc_per_node=4 19_qlora_legal_sft.py \
        --base_model Qwen/Qwen2.5-14B --data_dir data/legal --output_dir runs/legal-qlora
"""
import argparse
import contextlib
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    get_cosine_schedule_with_warmup,
    set_seed,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

logger = logging.getLogger("legal-qlora")

SYSTEM = "You are a careful legal drafting assistant. Rewrite clauses exactly as instructed."


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base_model", default="Qwen/Qwen2.5-14B")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", default="runs/legal-qlora")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lora_r", type=int, default=32)
    ap.add_argument("--lora_alpha", type=int, default=64)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def make_preprocess(tok, max_len):
    def preprocess(ex):
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{ex['instruction']}\n\nClause:\n{ex['clause']}"}]
        prompt_ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        target_ids = tok(ex["rewritten"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + target_ids)[:max_len]
        labels = ([-100] * len(prompt_ids) + target_ids)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}
    return preprocess


@torch.no_grad()
def evaluate(peft_model, loader, device):
    peft_model.eval()
    t = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = peft_model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        t[0] += out.loss.float() * n
        t[1] += n
    dist.all_reduce(t)
    peft_model.train()
    return (t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    tok = AutoTokenizer.from_pretrained(args.base_model)
    tok.padding_side = "right"

    raw = load_dataset("json", data_files={"train": os.path.join(args.data_dir, "train.jsonl"),
                                           "validation": os.path.join(args.data_dir, "validation.jsonl")})
    if rank == 0:
        processed = raw.map(make_preprocess(tok, args.max_len), remove_columns=raw["train"].column_names)
    dist.barrier()
    if rank != 0:
        processed = raw.map(make_preprocess(tok, args.max_len), remove_columns=raw["train"].column_names)

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.base_model, quantization_config=bnb,
                                                 torch_dtype=torch.bfloat16, device_map={"": 0})
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if rank == 0:
        peft_model.print_trainable_parameters()
    ddp_model = DDP(peft_model, device_ids=[local_rank])

    collator = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(processed["train"], shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(processed["validation"], shuffle=False, drop_last=True)
    train_loader = DataLoader(processed["train"], batch_size=args.micro_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    val_loader = DataLoader(processed["validation"], batch_size=args.micro_batch_size,
                            sampler=val_sampler, collate_fn=collator)

    params = [p for p in ddp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    updates = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * updates), updates)

    writer = SummaryWriter(os.path.join(args.output_dir, "runs")) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last = (i + 1) % args.grad_accum == 0 or (i + 1) == len(train_loader)
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp_model(**batch).loss / args.grad_accum
                loss.backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if writer is not None and step % 10 == 0:
                writer.add_scalar("train/loss", loss.item() * args.grad_accum, step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            val_loss = evaluate(peft_model, val_loader, device)
        logger.info("epoch %d val loss %.4f ppl %.2f", epoch, val_loss, math.exp(val_loss))
        if rank == 0:
            writer.add_scalar("val/loss", val_loss, step)
            save_to = os.path.join(args.output_dir, f"epoch_{epoch}")
            peft_model.save_pretrained(save_to)
            tok.save_pretrained(save_to)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
