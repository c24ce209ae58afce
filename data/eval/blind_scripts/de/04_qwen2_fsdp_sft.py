"""Supervised fine-tuning of Qwen2-7B with PyTorch FSDP (full shard, bf16).

torchrun --nnodes 1 --nproc_per_node 8 04_qwen2_fsdp_sft.py --config configs/qwen2_7b_sft.yaml
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

DEFAULTS = dict(
    model="Qwen/Qwen2-7B",
    train_file="data/sft_train.jsonl",
    eval_file="data/sft_eval.jsonl",
    output_dir="checkpoints/qwen2-7b-sft",
    max_len=2048,
    micro_batch=2,
    grad_accum=4,
    lr=1e-5,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    epochs=2,
    warmup_steps=100,
    eval_every=500,
    log_every=10,
    seed=0,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


class ChatSFTDataset(Dataset):
    """Each line: {"messages": [{"role": ..., "content": ...}, ...]}; loss on assistant turns only."""

    def __init__(self, path, tokenizer, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                ids, labels = self._encode(msgs, tokenizer)
                ids, labels = ids[:max_len], labels[:max_len]
                if any(l != -100 for l in labels):
                    self.items.append((ids, labels))

    @staticmethod
    def _encode(msgs, tokenizer):
        ids, labels = [], []
        prev = 0
        for i, m in enumerate(msgs):
            # render the conversation up to and including turn i; the new suffix belongs to turn i
            if m["role"] == "assistant":
                prompt = tokenizer.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True)
                full = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True)
                labels += [-100] * (len(prompt) - prev) + full[len(prompt):]
                ids = full
                prev = len(full)
            else:
                full = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=True)
                labels += [-100] * (len(full) - prev)
                ids = full
                prev = len(full)
        return ids, labels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch, pad_id):
    L = max(len(x[0]) for x in batch)
    input_ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    losses = []
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        losses.append(model(**batch).loss.item())
    model.train()
    return sum(losses) / max(len(losses), 1)


def save_full_checkpoint(model, tokenizer, out_dir, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()


def main():
    args = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    train_ds = ChatSFTDataset(args.train_file, tokenizer, args.max_len)
    eval_ds = ChatSFTDataset(args.eval_file, tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    col = functools.partial(collate, pad_id=pad_id)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=col, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.micro_batch, sampler=eval_sampler,
                             collate_fn=col, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=False,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Qwen2DecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95), fused=True)
    total_steps = args.epochs * (len(train_loader) // args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        print(f"world={world} train={len(train_ds)} eval={len(eval_ds)} total_steps={total_steps}", flush=True)

    step = 0
    tic = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        acc_loss = torch.zeros((), device="cuda")
        for i, batch in enumerate(train_loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.grad_accum
            loss.backward()
            acc_loss += loss.detach()
            if (i + 1) % args.grad_accum:
                continue
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total_steps} loss {acc_loss.item():.4f} "
                          f"gnorm {gnorm.item():.2f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - tic) / args.log_every:.2f}s/it", flush=True)
                tic = time.time()
            acc_loss.zero_()

            if step % args.eval_every == 0:
                eval_loss = evaluate(model, eval_loader)
                if rank == 0:
                    print(f"[eval] step {step} loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}", flush=True)

        save_full_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"epoch{epoch}"), rank)

    eval_loss = evaluate(model, eval_loader)
    if rank == 0:
        print(f"[final eval] loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}", flush=True)
    save_full_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
