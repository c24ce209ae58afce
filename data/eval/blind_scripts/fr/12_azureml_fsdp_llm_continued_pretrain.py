"""Continued pretraining of a 7B decoder on domain text with FSDP (full shard) on Azure ML.

    az ml job create -f cpt.yml
    # cpt.yml
    command: python cpt_fsdp.py --data ${{inputs.tokens}} --base ${{inputs.base}} --out ${{outputs.ckpt}}
    distribution: {type: pytorch, process_count_per_instance: 8}
    resources: {instance_count: 4}          # ND96amsr_A100_v4
    outputs: {ckpt: {type: uri_folder, mode: rw_mount}}
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                    FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-bs", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=1000)
    return ap.parse_args()


class PackedTokens(Dataset):
    def __init__(self, folder, seq_len):
        self.arrays = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(os.path.join(folder, "*.npy")))]
        self.seq_len = seq_len
        self.offsets = np.cumsum([0] + [len(a) // (seq_len + 1) for a in self.arrays])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - self.offsets[k]
        chunk = np.asarray(self.arrays[k][j * (self.seq_len + 1):(j + 1) * (self.seq_len + 1)], dtype=np.int64)
        return torch.from_numpy(chunk)


def cosine_lr(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def save_full_checkpoint(model, optimizer, step, out_dir, rank):
    # all ranks take part in gathering; only rank 0 receives the full tensors (on CPU)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        path = os.path.join(out_dir, f"step_{step:06d}")
        os.makedirs(path, exist_ok=True)
        torch.save(model_state, os.path.join(path, "model.pt"))
        torch.save({"optim": optim_state, "step": step}, os.path.join(path, "optim.pt"))
        with open(os.path.join(out_dir, "latest"), "w") as f:
            f.write(os.path.basename(path))
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    resume_dir = None
    latest_file = os.path.join(args.out, "latest")
    if os.path.exists(latest_file):
        with open(latest_file) as f:
            resume_dir = os.path.join(args.out, f.read().strip())

    # Rank 0 materialises the weights, the other ranks build on the meta device and
    # receive them through sync_module_states.
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
        if resume_dir is not None:
            model.load_state_dict(torch.load(os.path.join(resume_dir, "model.pt"), map_location="cpu"))
    else:
        config = AutoConfig.from_pretrained(args.base)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False))
        if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    if resume_dir is not None:
        full_osd = None
        if rank == 0:
            full_osd = torch.load(os.path.join(resume_dir, "optim.pt"), map_location="cpu")
        obj = [full_osd["step"] if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        step = obj[0]
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sharded = FSDP.optim_state_dict_to_load(model, optimizer,
                                                    full_osd["optim"] if rank == 0 else {})
        optimizer.load_state_dict(sharded)
        if rank == 0:
            print(f"resumed from {resume_dir} at step {step}", flush=True)

    dataset = PackedTokens(args.data, args.seq_len)
    sampler = DistributedSampler(dataset, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.micro_bs, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)
    tokens_per_step = args.micro_bs * args.grad_accum * args.seq_len * world

    epoch = step * args.grad_accum // len(loader)
    model.train()
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            batch = batch.cuda(non_blocking=True)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            last_micro = (i + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                logits = model(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
                (loss / args.grad_accum).backward()
            if not last_micro:
                continue
            for g in optimizer.param_groups:
                g["lr"] = cosine_lr(step, args)
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = time.time() - t0
                    print(f"step {step} loss {l.item():.4f} lr {cosine_lr(step, args):.2e} "
                          f"tok/s {20 * tokens_per_step / dt:.0f}", flush=True)
                t0 = time.time()
            if step % args.save_every == 0 or step == args.max_steps:
                save_full_checkpoint(model, optimizer, step, args.out, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
