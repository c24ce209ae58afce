#!/usr/bin/env python
# QLoRA fine-tuning with resumable checkpoints (preemptible queue).
#
#   torchrun --nproc_per_node=8 06_qlora_kb_continued.py --config configs/qlora_kb.json
#   torchrun --nproc_per_node=8 06_qlora_kb_continued.py --config configs/qlora_kb.json \
#       --resume_from runs/qlora-kb/ckpt-3000
import argparse
import glob
import json
import math
import os
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForLanguageModeling,
    get_cosine_schedule_with_warmup,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training, set_peft_model_state_dict
import wandb


@dataclass
class Config:
    model_name: str = "mistralai/Mistral-7B-v0.1"
    data_path: str = "data/kb_passages.jsonl"
    output_dir: str = "runs/qlora-kb"
    block_size: int = 1024
    micro_batch: int = 4
    grad_accum: int = 2
    lr: float = 2e-4
    max_steps: int = 10000
    warmup: int = 200
    save_every: int = 1000
    keep_last: int = 3
    lora_r: int = 32
    lora_alpha: int = 16
    lora_targets: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"])
    wandb_project: str = "kb-continued-pretrain"


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)
    return cfg


def build_dataset(cfg, tokenizer):
    raw = load_dataset("json", data_files=cfg.data_path, split="train", keep_in_memory=True)

    def tok(batch):
        return tokenizer(batch["text"])

    def group(batch):
        concat = sum(batch["input_ids"], [])
        n = len(concat) // cfg.block_size * cfg.block_size
        blocks = [concat[i: i + cfg.block_size] for i in range(0, n, cfg.block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * cfg.block_size for _ in blocks]}

    ds = raw.map(tok, batched=True, remove_columns=raw.column_names, keep_in_memory=True)
    return ds.map(group, batched=True, remove_columns=ds.column_names, keep_in_memory=True)


def save_checkpoint(ddp_model, optimizer, scheduler, step, epoch, cfg):
    ckpt = os.path.join(cfg.output_dir, f"ckpt-{step}")
    ddp_model.module.save_pretrained(ckpt)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch": epoch}, os.path.join(ckpt, "training_state.pt"))
    old = sorted(glob.glob(os.path.join(cfg.output_dir, "ckpt-*")),
                 key=lambda p: int(p.rsplit("-", 1)[1]))
    for p in old[: -cfg.keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume_from", default=None)
    cli = ap.parse_args()
    cfg = load_config(cli.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name)
    tokenizer.pad_token = tokenizer.eos_token

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_name, quantization_config=quant,
                                                 torch_dtype=torch.bfloat16,
                                                 device_map={"": local_rank})
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.05,
                                             target_modules=cfg.lora_targets, task_type="CAUSAL_LM"))

    if cli.resume_from:
        adapter = load_file(os.path.join(cli.resume_from, "adapter_model.safetensors"), device="cpu")
        set_peft_model_state_dict(model, adapter)

    ddp_model = DDP(model, device_ids=[local_rank])

    ds = build_dataset(cfg, tokenizer)
    sampler = DistributedSampler(ds, shuffle=True, seed=1234)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    loader = DataLoader(ds, batch_size=cfg.micro_batch, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    params = [p for p in ddp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup, cfg.max_steps)

    step, start_epoch = 0, 0
    if cli.resume_from:
        state = torch.load(os.path.join(cli.resume_from, "training_state.pt"))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, start_epoch = state["step"], state["epoch"]
        del state

    if rank == 0:
        wandb.init(project=cfg.wandb_project, config=vars(cfg), resume="allow",
                   name=os.path.basename(cfg.output_dir))
        os.makedirs(cfg.output_dir, exist_ok=True)

    micro = 0
    epoch = start_epoch
    ddp_model.train()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp_model(**batch).loss / cfg.grad_accum
            loss.backward()
            micro += 1
            if micro % cfg.grad_accum:
                continue

            gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                tl = loss.detach() * cfg.grad_accum
                dist.all_reduce(tl, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": tl.item(), "ppl": math.exp(min(tl.item(), 20)),
                               "grad_norm": gnorm.item(), "lr": scheduler.get_last_lr()[0],
                               "epoch": epoch}, step=step)

            if step % cfg.save_every == 0:
                if rank == 0:
                    save_checkpoint(ddp_model, optimizer, scheduler, step, epoch, cfg)
                dist.barrier()

            if step >= cfg.max_steps:
                break
        epoch += 1

    if rank == 0:
        ddp_model.module.save_pretrained(os.path.join(cfg.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(cfg.output_dir, "final"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
