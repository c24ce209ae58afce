"""Supervised fine-tuning of a 7B chat model on our support-conversation dataset with DeepSpeed ZeRO-3.

    deepspeed --num_nodes 2 --num_gpus 8 --hostfile /etc/mpi/hostfile 11_chat_sft_zero3.py \
        --model /models/mistral-7b-v0.3 --data /data/support_chats.jsonl --out /ckpt/sft-support
"""
import argparse
import json
import math
import os
import random

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

IGNORE_INDEX = -100


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def ds_config(args, world_size):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 1, "warmup_num_steps": 1, "warmup_min_ratio": 0.0}},
        "steps_per_print": 50,
    }


class ChatSFTDataset(Dataset):
    """Renders each conversation with the chat template and masks everything except assistant turns."""

    def __init__(self, path, tokenizer, max_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        messages = self.rows[i]["messages"]
        input_ids, labels = [], []
        for turn_idx in range(len(messages)):
            prefix = self.tok.apply_chat_template(messages[:turn_idx], tokenize=True) if turn_idx else []
            full = self.tok.apply_chat_template(messages[:turn_idx + 1], tokenize=True)
            new = full[len(prefix):]
            input_ids += new
            labels += new if messages[turn_idx]["role"] == "assistant" else [IGNORE_INDEX] * len(new)
        return torch.tensor(input_ids[: self.max_len]), torch.tensor(labels[: self.max_len])


def make_collate(pad_id):
    def collate(batch):
        ids, labels = zip(*batch)
        n = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), n), pad_id, dtype=torch.long)
        lab = torch.full((len(ids), n), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(ids), n), dtype=torch.long)
        for i, (x, y) in enumerate(zip(ids, labels)):
            input_ids[i, : len(x)], lab[i, : len(y)], attn[i, : len(x)] = x, y, 1
        return {"input_ids": input_ids, "attention_mask": attn, "labels": lab}
    return collate


def save_model(engine, tokenizer, out_dir, tag):
    path = os.path.join(out_dir, tag)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        state = {k: v.to(torch.bfloat16).cpu() for k, v in engine.module.state_dict().items()}
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        engine.module.config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    dist.barrier()


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    random.seed(0)
    torch.manual_seed(0)

    cfg = ds_config(args, world_size)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  (must stay alive so from_pretrained uses zero.Init)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False

    ds = ChatSFTDataset(args.data, tokenizer, args.max_len)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=make_collate(tokenizer.pad_token_id),
                        num_workers=2, pin_memory=True)
    total_steps = math.ceil(len(loader) / args.grad_accum) * args.epochs
    cfg["scheduler"]["params"].update(total_num_steps=total_steps, warmup_num_steps=max(1, int(0.03 * total_steps)))

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    device = engine.device

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        running = torch.zeros(2, device=device)
        for step, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 20 == 0:
                stats = running.clone()
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} step {engine.global_steps} loss {(stats[0] / stats[1]).item():.4f} "
                          f"lr {engine.get_lr()[0]:.2e}", flush=True)
                running.zero_()
        save_model(engine, tokenizer, args.out, f"epoch_{epoch}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
