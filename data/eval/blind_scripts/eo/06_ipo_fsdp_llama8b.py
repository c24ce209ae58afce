#!/usr/bin/env python
"""IPO on Llama-3.1-8B-SFT with FSDP (full shard), policy + frozen reference both sharded.

Only rank 0 reads the safetensors from disk; the other ranks build the model on the meta
device and receive the weights through FSDP's sync_module_states broadcast.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        06_ipo_fsdp_llama8b.py --model /shared/ckpts/llama3.1-8b-sft --train /shared/data/ipo_train.jsonl \
        --valid /shared/data/ipo_valid.jsonl --out /shared/runs/ipo-8b
"""
import argparse
import functools
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE = -100


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-7)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--max_prompt_len", type=int, default=1024)
    ap.add_argument("--eval_every", type=int, default=100)
    return ap.parse_args()


def tokenize_jsonl(path, tok, max_len, max_prompt_len):
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                        add_generation_prompt=True)[-max_prompt_len:]
            c = tok(r["chosen"] + "<|eot_id|>", add_special_tokens=False).input_ids[: max_len - len(p)]
            j = tok(r["rejected"] + "<|eot_id|>", add_special_tokens=False).input_ids[: max_len - len(p)]
            rows.append((p, c, j))
    return rows


def load_tokenized(path, tok, args, rank):
    cache = f"{path}.llama3-{args.max_len}-{args.max_prompt_len}.pt"
    if rank == 0 and not os.path.exists(cache):
        rows = tokenize_jsonl(path, tok, args.max_len, args.max_prompt_len)
        torch.save(rows, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()  # everyone waits until rank 0 has written the cache
    return torch.load(cache)


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad):
        self.pad = pad

    def __call__(self, batch):
        seqs = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(a) + len(b) for a, b in seqs)
        ids = torch.full((len(seqs), T), self.pad, dtype=torch.long)
        lab = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(seqs), T), dtype=torch.long)
        for k, (a, b) in enumerate(seqs):
            ids[k, : len(a) + len(b)] = torch.tensor(a + b)
            lab[k, len(a): len(a) + len(b)] = torch.tensor(b)
            att[k, : len(a) + len(b)] = 1
        return ids, att, lab


def build_fsdp(path, rank, dtype, mp, trainable):
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, low_cpu_mem_usage=True)
    else:
        cfg = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    if trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    else:
        model.requires_grad_(False)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp,
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False)) if rank != 0 else None,
        use_orig_params=False,
        limit_all_gathers=True,
    )


def mean_logps(model, ids, att, lab):
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = (tgt != IGNORE).float()
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = (lp * m).sum(-1) / m.sum(-1).clamp(min=1)
    n = lp.shape[0] // 2
    return lp[:n], lp[n:]


@torch.no_grad()
def evaluate(policy, ref, loader, tau):
    policy.eval()
    acc = torch.zeros(3, device="cuda")
    for ids, att, lab in loader:
        ids, att, lab = ids.cuda(), att.cuda(), lab.cuda()
        pc, pr = mean_logps(policy, ids, att, lab)
        rc, rr = mean_logps(ref, ids, att, lab)
        h = (pc - pr) - (rc - rr)
        acc += torch.stack([((h - 1 / (2 * tau)) ** 2).sum(), (h > 0).float().sum(), h.new_tensor(h.numel())])
    dist.all_reduce(acc)
    policy.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def save(policy, tok, out_dir, rank):
    # every rank has to enter state_dict(): it all-gathers the shards
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(policy, StateDictType.FULL_STATE_DICT, cfg):
        state = policy.state_dict()
    if rank == 0:
        policy.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tok.save_pretrained(out_dir)
    dist.barrier()


def main():
    args = parse()
    # long timeout: rank 0 may spend a while tokenising before the first barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"
    train = Rows(load_tokenized(args.train, tok, args, rank))
    valid = Rows(load_tokenized(args.valid, tok, args, rank))
    collate = Collate(tok.pad_token_id)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    # drop_last so that every rank runs the same number of sharded forwards
    va_sampler = DistributedSampler(valid, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=2,
                           pin_memory=True)
    va_loader = DataLoader(valid, batch_size=args.bs, sampler=va_sampler, collate_fn=collate, num_workers=2)

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    policy = build_fsdp(args.model, rank, torch.float32, mp, trainable=True)
    ref = build_fsdp(args.model, rank, torch.bfloat16, None, trainable=False)
    ref.eval()

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} pairs={len(train)} steps/epoch={len(tr_loader)}", flush=True)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for ids, att, lab in tr_loader:
            ids, att, lab = ids.cuda(non_blocking=True), att.cuda(non_blocking=True), lab.cuda(non_blocking=True)
            pc, pr = mean_logps(policy, ids, att, lab)
            with torch.no_grad():
                rc, rr = mean_logps(ref, ids, att, lab)
            h = (pc - pr) - (rc - rr)
            loss = ((h - 1 / (2 * args.tau)) ** 2).mean()
            loss.backward()
            gnorm = policy.clip_grad_norm_(1.0)  # FSDP's own: the norm over all shards
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                s = torch.stack([loss.detach(), (h > 0).float().mean(), h.detach().mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {s[0]:.4f} acc {s[1]:.3f} h {s[2]:.3f} gnorm {gnorm:.3f} "
                          f"{time.time() - t0:.0f}s", flush=True)
            if step % args.eval_every == 0:
                vloss, vacc = evaluate(policy, ref, va_loader, args.tau)
                if rank == 0:
                    print(f"[eval] step {step} loss {vloss:.4f} acc {vacc:.4f}", flush=True)

    save(policy, tok, os.path.join(args.out, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
