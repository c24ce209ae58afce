"""Instruction tuning Llama-3.1-8B with FSDP FULL_SHARD, bf16 params, fp32 reduce, activation checkpointing.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
    14_fsdp_llama8b_instruct.py --data /shared/data/instruct_200k.jsonl --out /shared/ckpt/llama8b-inst
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    BackwardPrefetch,
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

PROMPT = "Below is an instruction. Write a response that completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"


class InstructData(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                p = tok(PROMPT.format(instruction=ex["instruction"]), add_special_tokens=True)["input_ids"]
                r = tok(ex["output"] + tok.eos_token, add_special_tokens=False)["input_ids"]
                ids = (p + r)[:max_len]
                labels = ([-100] * len(p) + r)[:max_len]
                self.items.append((ids, labels))
        self.max_len = max_len
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, labels = self.items[i]
        n = len(ids)
        x = torch.full((self.max_len,), self.pad, dtype=torch.long)
        y = torch.full((self.max_len,), -100, dtype=torch.long)
        m = torch.zeros(self.max_len, dtype=torch.long)
        x[:n], y[:n], m[:n] = torch.tensor(ids), torch.tensor(labels), 1
        return x, y, m


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = InstructData(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)

    # real weights only on rank 0, meta tensors elsewhere; FSDP broadcasts via sync_module_states
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")
    else:
        cfg = AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
        use_orig_params=True,
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=device, recurse=False)) if rank != 0 else None,
        device_id=device,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} examples, {len(dl)} steps/epoch/rank, world {world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        tokens = torch.zeros((), device=device)
        for x, y, m in dl:
            x, y, m = (t.to(device, non_blocking=True) for t in (x, y, m))
            out = model(input_ids=x, attention_mask=m, labels=y)
            out.loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += m.sum()

            if step % args.log_every == 0:
                stats = torch.stack([out.loss.detach().float(), tokens])
                dist.all_reduce(stats)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {stats[0].item() / world:.4f} "
                          f"gnorm {gnorm.item():.2f} {stats[1].item() / dt:,.0f} tok/s", flush=True)
                tokens.zero_()
                t0 = time.perf_counter()

        # consolidated checkpoint after each epoch, loadable with from_pretrained
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        if rank == 0:
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
                cpu_state = model.state_dict()
            save_dir = os.path.join(args.out, f"epoch_{epoch}")
            model.module.save_pretrained(save_dir, state_dict=cpu_state, safe_serialization=True)
            tok.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
