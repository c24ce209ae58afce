"""LoRA fine-tuning of CodeLlama-7B on Code Alpaca, multi-GPU DDP.

    torchrun --nproc_per_node=4 14_lora_codealpaca_ddp.py --output_dir ckpts/codellama-lora
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model, set_peft_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)

PROMPT = "You are a helpful coding assistant.\n\n### Instruction:\n{instruction}\n\n{context}### Response:\n"


def get_parser():
    parser = argparse.ArgumentParser(description="LoRA SFT on Code Alpaca")
    parser.add_argument("--base_model", default="codellama/CodeLlama-7b-hf")
    parser.add_argument("--data", default="sahil2801/CodeAlpaca-20k")
    parser.add_argument("--output_dir", default="ckpts/lora")
    parser.add_argument("--cutoff_len", type=int, default=768)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--val_set_size", type=int, default=1000)
    parser.add_argument("--resume_adapter", default=None)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def tokenize(example, tokenizer, cutoff_len):
    context = f"### Input:\n{example['input']}\n\n" if example["input"] else ""
    prompt = PROMPT.format(instruction=example["instruction"], context=context)
    full = prompt + example["output"]
    enc = tokenizer(full, truncation=True, max_length=cutoff_len, padding=False)
    if enc["input_ids"][-1] != tokenizer.eos_token_id and len(enc["input_ids"]) < cutoff_len:
        enc["input_ids"].append(tokenizer.eos_token_id)
        enc["attention_mask"].append(1)
    n_prompt = len(tokenizer(prompt, truncation=True, max_length=cutoff_len)["input_ids"])
    enc["labels"] = [-100] * n_prompt + enc["input_ids"][n_prompt:]
    return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss = model(**batch).loss
        total += torch.stack([loss.float() * batch["input_ids"].size(0),
                              torch.tensor(float(batch["input_ids"].size(0)), device=device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    tokenizer.pad_token_id = 0
    tokenizer.padding_side = "left"

    if rank > 0:
        dist.barrier()
    data = load_dataset(args.data)["train"]
    split = data.train_test_split(test_size=args.val_set_size, shuffle=True, seed=42)
    train_data = split["train"].map(tokenize, fn_kwargs={"tokenizer": tokenizer, "cutoff_len": args.cutoff_len},
                                    remove_columns=data.column_names)
    val_data = split["test"].map(tokenize, fn_kwargs={"tokenizer": tokenizer, "cutoff_len": args.cutoff_len},
                                 remove_columns=data.column_names)
    if rank == 0:
        dist.barrier()

    collator = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, return_tensors="pt", padding=True)
    train_sampler = DistributedSampler(train_data, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_data, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_data, batch_size=args.micro_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_data, batch_size=args.micro_batch_size, sampler=val_sampler, collate_fn=collator)

    model = AutoModelForCausalLM.from_pretrained(args.base_model, torch_dtype=torch.float16)
    lora_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_dropout=args.lora_dropout,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
    )
    model = get_peft_model(model, lora_config)
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if args.resume_adapter:
        adapter_weights = torch.load(os.path.join(args.resume_adapter, "adapter_model.bin"), map_location="cpu")
        set_peft_model_state_dict(model, adapter_weights)
        log.info("loaded adapter from %s", args.resume_adapter)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_steps = steps_per_epoch * args.num_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, 100, total_steps)
    scaler = torch.cuda.amp.GradScaler()

    log.info("world_size=%d, train=%d, val=%d, total_steps=%d", world_size, len(train_data), len(val_data), total_steps)
    global_step = 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            update = (it + 1) % args.gradient_accumulation_steps == 0 or (it + 1) == len(train_loader)
            ctx = model.no_sync() if not update else torch.enable_grad()
            with ctx:
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    loss = model(**batch).loss / args.gradient_accumulation_steps
                scaler.scale(loss).backward()
            if not update:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % 20 == 0:
                step_loss = loss.detach().float() * args.gradient_accumulation_steps
                dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d/%d loss %.4f lr %.2e (%.1fs)", epoch, global_step, total_steps,
                         step_loss.item(), scheduler.get_last_lr()[0], time.time() - t0)
                t0 = time.time()

        val_loss = evaluate(model, val_loader, device)
        log.info("epoch %d: val_loss %.4f", epoch, val_loss)
        if rank == 0:
            model.module.save_pretrained(os.path.join(args.output_dir, f"epoch_{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
