#!/usr/bin/env python
"""QLoRA domain adaptation (finance filings Q&A), DDP with one 4-bit replica per GPU.

After training, rank 0 reloads the base model in bf16 on the CPU, merges the adapter
and writes a standalone checkpoint for the serving team.

    torchrun --nproc_per_node=8 08_qlora_domain_adapt.py \
        --base meta-llama/Meta-Llama-3-8B --train data/fin/train.jsonl \
        --valid data/fin/valid.jsonl --out runs/fin-qlora --merge
"""
import argparse
import contextlib
import functools
import json
import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    get_cosine_schedule_with_warmup,
    set_seed,
)
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

logger = logging.getLogger("fin-qlora")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="meta-llama/Meta-Llama-3-8B")
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", default="runs/fin-qlora")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--r", type=int, default=64)
    p.add_argument("--alpha", type=int, default=128)
    p.add_argument("--eval_every", type=int, default=300)
    p.add_argument("--resume", default=None, help="path to training_state.pt")
    p.add_argument("--merge", action="store_true")
    p.add_argument("--seed", type=int, default=3407)
    return p.parse_args()


class QADataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.samples = []
        for line in open(path):
            ex = json.loads(line)
            prompt = f"Context:\n{ex['context']}\n\nQuestion: {ex['question']}\nAnswer:"
            p_ids = tok(prompt)["input_ids"]
            a_ids = tok(" " + ex["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            keep = max_len - len(a_ids)
            if keep <= 0:
                continue
            p_ids = p_ids[-keep:]  # keep the end of the context, near the question
            self.samples.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate_fn(batch, pad_id):
    L = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), L), -100, dtype=torch.long)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


@torch.no_grad()
def evaluate(peft_model, loader, device):
    peft_model.eval()
    stats = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = peft_model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        stats += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    peft_model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def merge_and_export(base_name, adapter_dir, out_dir):
    base = AutoModelForCausalLM.from_pretrained(base_name, torch_dtype=torch.bfloat16,
                                                device_map={"": "cpu"}, low_cpu_mem_usage=True)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True, max_shard_size="4GB")
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    set_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.pad_token or tok.eos_token

    # every process keeps a full 4-bit copy on its own GPU
    model = AutoModelForCausalLM.from_pretrained(
        args.base,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16,
        device_map={"": local_rank},
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(
        r=args.r, lora_alpha=args.alpha, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ddp = DDP(peft_model, device_ids=[local_rank], find_unused_parameters=False)

    train_ds = QADataset(args.train, tok, args.max_len)
    valid_ds = QADataset(args.valid, tok, args.max_len)
    col = functools.partial(collate_fn, pad_id=tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=col,
                          num_workers=4, pin_memory=True, persistent_workers=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world_size)),
                          batch_size=args.bs, collate_fn=col)

    params = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.999))
    steps_per_epoch = math.ceil(len(train_dl) / args.accum)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)

    start_epoch, step = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        peft_model.load_state_dict(state["lora"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, step = state["epoch"] + 1, state["step"]

    writer = SummaryWriter(os.path.join(args.out, "logs")) if rank == 0 else None
    adapter_dir = os.path.join(args.out, "adapter")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.accum == 0 or i + 1 == len(train_dl)
            with contextlib.nullcontext() if sync_now else ddp.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp(**batch).loss / args.accum
                loss.backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(params, 0.3)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if writer and step % 10 == 0:
                writer.add_scalar("loss/train", loss.item() * args.accum, step)
                writer.add_scalar("lr", scheduler.get_last_lr()[0], step)
            if step % args.eval_every == 0:
                vl = evaluate(peft_model, valid_dl, device)
                logger.info("step %d valid loss %.4f", step, vl)
                if writer:
                    writer.add_scalar("loss/valid", vl, step)

        if rank == 0:
            peft_model.save_pretrained(adapter_dir)
            tok.save_pretrained(adapter_dir)
            lora_sd = {k: v.cpu() for k, v in peft_model.state_dict().items() if "lora_" in k}
            torch.save({"lora": lora_sd, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "training_state.pt"))
        dist.barrier()

    vl = evaluate(peft_model, valid_dl, device)
    logger.info("final valid loss %.4f", vl)
    if writer:
        writer.add_scalar("loss/valid", vl, step)
        writer.close()

    dist.barrier()
    dist.destroy_process_group()

    # the merge only needs one process and no process group
    if rank == 0 and args.merge:
        del ddp, peft_model, model, optimizer
        torch.cuda.empty_cache()
        merge_and_export(args.base, adapter_dir, os.path.join(args.out, "merged"))
        logger.info("merged model written to %s", os.path.join(args.out, "merged"))


if __name__ == "__main__":
    main()
