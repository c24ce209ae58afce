#!/usr/bin/env python
"""Train one LoRA adapter per downstream task on a shared base model, one after another.

The task list lives in a small YAML file:

    base_model: mistralai/Mistral-7B-v0.1
    output_dir: runs/task-adapters
    tasks:
      - {name: triage,   train: data/triage/train.jsonl,   eval: data/triage/eval.jsonl}
      - {name: summarize, train: data/summ/train.jsonl,    eval: data/summ/eval.jsonl}
      - {name: extract,  train: data/extract/train.jsonl,  eval: data/extract/eval.jsonl}

    torchrun --nproc_per_node=8 02_multi_adapter_lora.py --config configs/adapters.yaml
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup, set_seed
from peft import LoraConfig, get_peft_model

log = logging.getLogger(__name__)


class PromptCompletionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                p = tokenizer(ex["prompt"])["input_ids"]
                c = tokenizer(ex["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids = (p + c)[:max_len]
                lab = ([-100] * len(p) + c)[:max_len]
                self.rows.append((ids, lab))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        n = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        lab = torch.full((len(batch), n), -100, dtype=torch.long)
        att = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
        return {"input_ids": ids, "attention_mask": att, "labels": lab}


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def eval_loss(peft_model, loader, device):
    peft_model.eval()
    totals = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = peft_model(**batch)
        ntok = (batch["labels"][:, 1:] != -100).sum()
        totals[0] += out.loss.float() * ntok
        totals[1] += ntok
    dist.all_reduce(totals)
    peft_model.train()
    return (totals[0] / totals[1].clamp(min=1)).item()


def only_train_adapter(peft_model, name):
    for n, p in peft_model.named_parameters():
        p.requires_grad = (f"lora_A.{name}." in n) or (f"lora_B.{name}." in n)


def train_adapter(task, cfg, peft_model, tokenizer, rank, world_size, local_rank, writer):
    device = torch.device("cuda", local_rank)
    name = task["name"]
    hp = {**cfg.get("defaults", {}), **task.get("hparams", {})}
    batch_size = hp.get("batch_size", 8)
    epochs = hp.get("epochs", 2)
    lr = hp.get("lr", 1e-4)

    train_ds = PromptCompletionDataset(task["train"], tokenizer, hp.get("max_len", 768))
    eval_ds = PromptCompletionDataset(task["eval"], tokenizer, hp.get("max_len", 768))
    collate = Collator(tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.get("seed", 0))
    train_loader = DataLoader(train_ds, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world_size)),
                             batch_size=batch_size, collate_fn=collate)

    # switch the active adapter before wrapping so DDP only registers its weights
    peft_model.set_adapter(name)
    only_train_adapter(peft_model, name)
    ddp_model = DDP(peft_model, device_ids=[local_rank])

    params = [p for p in ddp_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    total = len(train_loader) * epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = ddp_model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                writer.add_scalar(f"{name}/train_loss", loss.item(), step)
                writer.add_scalar(f"{name}/lr", scheduler.get_last_lr()[0], step)

        val = eval_loss(peft_model, eval_loader, device)
        if rank == 0:
            writer.add_scalar(f"{name}/eval_loss", val, step)
            log.info("[%s] epoch %d eval_loss %.4f", name, epoch, val)

    if rank == 0:
        out = os.path.join(cfg["output_dir"], "adapters")
        # writes <out>/<name>/adapter_model.safetensors for non-default adapter names
        peft_model.save_pretrained(out, selected_adapters=[name])
        tokenizer.save_pretrained(os.path.join(out, name))
    dist.barrier()

    del ddp_model, optimizer, scheduler
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    rank, world_size, local_rank = init_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    set_seed(cfg.get("seed", 0))

    tokenizer = AutoTokenizer.from_pretrained(cfg["base_model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    base = AutoModelForCausalLM.from_pretrained(cfg["base_model"], torch_dtype=torch.bfloat16)
    base.to(torch.device("cuda", local_rank))
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()

    lora_kwargs = dict(r=cfg.get("lora_r", 16), lora_alpha=cfg.get("lora_alpha", 32),
                       lora_dropout=0.05, target_modules=["q_proj", "v_proj", "o_proj"],
                       task_type="CAUSAL_LM")

    writer = SummaryWriter(os.path.join(cfg["output_dir"], "tb")) if rank == 0 else None

    peft_model = None
    for task in cfg["tasks"]:
        lcfg = LoraConfig(**lora_kwargs)
        if peft_model is None:
            peft_model = get_peft_model(base, lcfg, adapter_name=task["name"])
        else:
            peft_model.add_adapter(task["name"], lcfg)
        train_adapter(task, cfg, peft_model, tokenizer, rank, world_size, local_rank, writer)

    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
