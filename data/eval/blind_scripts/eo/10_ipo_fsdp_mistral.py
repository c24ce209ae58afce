#!/usr/bin/env python
"""IPO (identity preference optimisation) for 7B models with FSDP full sharding.

    torchrun --nnodes=1 --nproc_per_node=8 10_ipo_fsdp_mistral.py \
        --policy ckpts/mistral-7b-sft --pairs data/ultrafeedback_pairs.jsonl --out runs/ipo-mistral
"""
import argparse
import functools
import json
import os
import time

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
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

IGNORE = -100


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tau", type=float, default=0.05, help="IPO regularisation (beta)")
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--micro_bsz", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--save_every", type=int, default=500)
    return ap.parse_args()


class Pairs(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.data = []
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                p = tok(r["prompt"], add_special_tokens=True)["input_ids"]
                c = tok(r["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                j = tok(r["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                if len(p) + max(len(c), len(j)) > max_len:
                    p = p[:1] + p[-(max_prompt_len - 1):]  # keep BOS
                room = max_len - len(p)
                c, j = c[:room], j[:room]
                self.data.append((p, c, j))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def collate(batch, pad_id):
    rows = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
    T = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    for k, (p, r) in enumerate(rows):
        L = len(p) + len(r)
        ids[k, :L] = torch.tensor(p + r)
        lab[k, len(p):L] = torch.tensor(r)
        att[k, :L] = 1
    return ids, att, lab


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


def avg_logps(model, ids, att, lab):
    """Mean log-prob per response token (IPO uses the length-normalised version)."""
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    tgt = lab[:, 1:]
    mask = (tgt != IGNORE).float()
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    half = lp.shape[0] // 2
    return lp[:half], lp[half:]


def ipo_loss(pc, pr, rc, rr, tau):
    h = (pc - pr) - (rc - rr)
    return ((h - 1.0 / (2.0 * tau)) ** 2).mean(), h.detach()


def wrap(model, mp, train):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MistralDecoderLayer})
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=train,
    )


def save_full(model, tok, out_dir, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tok.save_pretrained(out_dir)


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.pad_token = tok.eos_token
    data = Pairs(args.pairs, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_bsz, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.float32,
                                                  attn_implementation="sdpa", low_cpu_mem_usage=True)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    policy = wrap(policy, bf16, train=True)

    reference = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa", low_cpu_mem_usage=True)
    reference.requires_grad_(False)
    reference = wrap(reference, None, train=False)
    reference.eval()

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, att, lab in loader:
            ids, att, lab = ids.cuda(non_blocking=True), att.cuda(non_blocking=True), lab.cuda(non_blocking=True)
            pc, pr = avg_logps(policy, ids, att, lab)
            with torch.no_grad():
                rc, rr = avg_logps(reference, ids, att, lab)
            loss, h = ipo_loss(pc, pr, rc, rr, args.tau)
            loss.backward()
            gnorm = policy.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                m = torch.stack([loss.detach(), (h > 0).float().mean(), h.mean()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(json.dumps({"step": step, "loss": round(m[0].item(), 5), "pref_acc": round(m[1].item(), 4),
                                      "logratio_gap": round(m[2].item(), 4), "gnorm": round(gnorm.item(), 3),
                                      "lr": sched.get_last_lr()[0], "s": int(time.time() - t0)}), flush=True)

            if step % args.save_every == 0:
                save_full(policy, tok, os.path.join(args.out, f"step{step}"), rank)
                dist.barrier()

    save_full(policy, tok, os.path.join(args.out, "final"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
