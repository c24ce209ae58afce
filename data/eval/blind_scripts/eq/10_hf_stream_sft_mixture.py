"""
Supervised fine-tuning of a small causal LM on a streamed mixture of chat datasets.

    torchrun --nproc_per_node=8 10_hf_stream_sft_mixture.py \
        --model Qwen/Qwen2-0.5B --max_steps 20000 --run_name qwen05b-sft-mix

The mixture is built with interleave_datasets (streaming), then split across ranks
with split_dataset_by_node. Training is counted in optimizer steps.
"""
import argparse
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import wandb
from datasets import interleave_datasets, load_dataset
from datasets.distributed import split_dataset_by_node
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SOURCES = {
    # name: (hf path, config, split, weight)
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft", 0.5),
    "oasst": ("OpenAssistant/oasst2_chat", None, "train", 0.2),
    "slimorca": ("Open-Orca/SlimOrca-chat", None, "train", 0.3),
}
IGNORE = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2-0.5B")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--per_device_bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup_steps", type=int, default=200)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--save_steps", type=int, default=2000)
    ap.add_argument("--output_dir", default="/shared/sft/qwen05b-mix")
    ap.add_argument("--wandb_project", default="sft-mixture")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


def to_messages(example):
    msgs = example.get("messages") or example.get("conversations")
    out = []
    for m in msgs:
        role = m.get("role") or {"human": "user", "gpt": "assistant", "system": "system"}[m["from"]]
        out.append({"role": role, "content": m.get("content") or m.get("value")})
    return out


def build_train_stream(tokenizer, args, rank, world_size):
    parts, probs = [], []
    for name, (path, cfg, split, w) in SOURCES.items():
        ds = load_dataset(path, cfg, split=split, streaming=True)
        ds = ds.map(lambda ex: {"messages": to_messages(ex)},
                    remove_columns=[c for c in (ds.column_names or []) if c != "messages"])
        parts.append(ds)
        probs.append(w)
    mix = interleave_datasets(parts, probabilities=probs, seed=args.seed,
                              stopping_strategy="all_exhausted")
    mix = mix.shuffle(seed=args.seed, buffer_size=5000)
    mix = split_dataset_by_node(mix, rank=rank, world_size=world_size)

    def encode(ex):
        msgs = ex["messages"]
        ids, labels = [], []
        for i in range(len(msgs)):
            prefix = tokenizer.apply_chat_template(msgs[:i], tokenize=True) if i else []
            full = tokenizer.apply_chat_template(msgs[:i + 1], tokenize=True)
            new = full[len(prefix):]
            ids.extend(new)
            labels.extend(new if msgs[i]["role"] == "assistant" else [IGNORE] * len(new))
        return {"input_ids": ids[:args.max_len], "labels": labels[:args.max_len]}

    return mix.map(encode, remove_columns=["messages"])


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), L), IGNORE, dtype=torch.long)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        lab[i, :n] = torch.tensor(b["labels"])
        att[i, :n] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_ds = build_train_stream(tokenizer, args, rank, world_size)
    loader = DataLoader(train_ds, batch_size=args.per_device_bs, num_workers=2,
                        collate_fn=partial(collate, pad_id=tokenizer.pad_token_id))

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    def batches():
        epoch = 0
        while True:
            train_ds.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = batches()
    model.train()
    t0 = time.time()
    for step in range(1, args.max_steps + 1):
        tokens = torch.zeros((), device=device)
        loss_log = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(it).items()}
            ctx = model.no_sync() if micro < args.grad_accum - 1 else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            loss_log += loss.detach()
            tokens += (batch["labels"] != IGNORE).sum()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step % 10 == 0:
            stats = torch.stack([loss_log, tokens.float()])
            dist.all_reduce(stats)
            wandb.log({"train/loss": (stats[0] / world_size).item(),
                       "train/target_tokens": stats[1].item(),
                       "train/grad_norm": gnorm.item(),
                       "train/lr": scheduler.get_last_lr()[0],
                       "perf/sec_per_step": (time.time() - t0) / 10}, step=step)
            t0 = time.time()

        if step % args.save_steps == 0 or step == args.max_steps:
            if rank == 0:
                out = os.path.join(args.output_dir, f"step-{step}")
                model.module.save_pretrained(out, safe_serialization=True)
                tokenizer.save_pretrained(out)
            dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
