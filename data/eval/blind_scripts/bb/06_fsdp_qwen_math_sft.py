#!/usr/bin/env python
# Full-parameter SFT of Qwen2.5 on math word problems with FSDP (torchrun).
#
#   torchrun --standalone --nproc_per_node=8 06_fsdp_qwen_math_sft.py --config configs/qwen3b_math.yaml
#
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

DEFAULTS = {
    "model": "Qwen/Qwen2.5-3B",
    "dataset": "meta-math/MetaMathQA",
    "out": "ckpt/qwen3b-metamath",
    "max_len": 1024,
    "micro_bsz": 4,
    "lr": 1e-5,
    "min_lr_ratio": 0.1,
    "epochs": 3,
    "warmup": 200,
    "eval_size": 2000,
    "eval_every": 500,
    "save_every": 2000,
    "seed": 7,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def build_features(ex, tok, max_len):
    msgs = [{"role": "user", "content": ex["query"]}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(ex["response"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = (p + r)[:max_len]
    return {"input_ids": ids, "labels": ([-100] * len(p) + r)[:max_len]}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    L = (L + 63) // 64 * 64
    ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), -100)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def cosine_lr(step, cfg, total):
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    s = torch.zeros(2, device="cuda")
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        loss = model(**batch).loss
        ntok = (batch["labels"][:, 1:] != -100).sum()
        s[0] += loss.float() * ntok
        s[1] += ntok
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def save_checkpoint(model, tok, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    model.module.save_pretrained(path, state_dict=state, safe_serialization=True)
    tok.save_pretrained(path)


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    if rank != 0:
        dist.barrier()
    raw = load_dataset(cfg.dataset, split="train").train_test_split(test_size=cfg.eval_size, seed=cfg.seed)
    data = raw.map(build_features, fn_kwargs={"tok": tok, "max_len": cfg.max_len},
                   remove_columns=raw["train"].column_names, num_proc=16)
    if rank == 0:
        dist.barrier()

    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=cfg.seed, drop_last=True)
    eval_sampler = DistributedSampler(data["test"], shuffle=False)
    col = functools.partial(collate, pad_id=pad_id)
    train_dl = DataLoader(data["train"], batch_size=cfg.micro_bsz, sampler=train_sampler, collate_fn=col,
                          num_workers=4, pin_memory=True)
    eval_dl = DataLoader(data["test"], batch_size=cfg.micro_bsz, sampler=eval_sampler, collate_fn=col)

    model = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=local_rank,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = cfg.epochs * len(train_dl)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "run_config.yaml"), "w") as f:
            yaml.safe_dump(vars(cfg), f)

    step = 0
    tic = time.time()
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, cfg, total)
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            gn = model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}] {step}/{total} loss={l.item():.4f} gnorm={gn.item():.2f} "
                          f"lr={opt.param_groups[0]['lr']:.2e} {(time.time() - tic) / 20:.2f}s/step", flush=True)
                tic = time.time()

            if step % cfg.eval_every == 0:
                vl = evaluate(model, eval_dl)
                if rank == 0:
                    print(f"step {step} eval_loss={vl:.4f}", flush=True)

            if step % cfg.save_every == 0:
                if rank == 0:
                    save_checkpoint(model, tok, os.path.join(cfg.out, f"step-{step}"))
                dist.barrier()

    vl = evaluate(model, eval_dl)
    if rank == 0:
        print(f"final eval_loss={vl:.4f}", flush=True)
        save_checkpoint(model, tok, os.path.join(cfg.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
