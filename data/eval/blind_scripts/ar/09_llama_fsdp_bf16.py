"""
Llama-style 1B pretraining with FSDP (bf16, activation checkpointing) on packed token windows.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        09_llama_fsdp_bf16.py --data /shared/tok/fineweb_llama --save_dir /shared/ckpt/llama1b
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class Windows(Dataset):
    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.arr = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = i * self.seq_len
        return torch.from_numpy(self.arr[s:s + self.seq_len + 1].astype(np.int64))


class SkipSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch (for mid-epoch resume)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.start = 0

    def __iter__(self):
        idx = list(super().__iter__())
        return iter(idx[self.start:])

    def __len__(self):
        return self.num_samples - self.start


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--save_every", type=int, default=2000)
    return p.parse_args()


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / (a.max_steps - a.warmup))
    return 0.1 * a.lr + 0.45 * a.lr * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, limit=100):
    model.eval()
    acc = torch.zeros(2, device="cuda", dtype=torch.float64)
    for i, b in enumerate(loader):
        if i == limit:
            break
        b = b.cuda(non_blocking=True)
        out = model(input_ids=b[:, :-1], labels=b[:, :-1].clone())
        acc[0] += out.loss.double() * b[:, :-1].numel()
        acc[1] += b[:, :-1].numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=a.seq_len,
                      rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)

    ckpt_file = os.path.join(a.save_dir, "last.pt")
    state = None
    if os.path.exists(ckpt_file):
        state = torch.load(ckpt_file, map_location="cpu", mmap=True, weights_only=False)
        model.load_state_dict(state["model"])

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=torch.cuda.current_device(),
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 use_orig_params=True, limit_all_gathers=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train_ds = Windows(os.path.join(a.data, "train.bin"), a.seq_len)
    val_ds = Windows(os.path.join(a.data, "val.bin"), a.seq_len)
    sampler = SkipSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=a.micro_batch, num_workers=2,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    step, epoch = 0, 0
    if state is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
        step, epoch = state["step"], state["epoch"]
        sampler.start = state["global_samples_in_epoch"] // world
        del state
    if rank == 0:
        os.makedirs(a.save_dir, exist_ok=True)

    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    osave_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    t0 = time.time()
    model.train()
    while step < a.max_steps:
        sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=a.micro_batch, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        for batch in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, a)
            batch = batch.cuda(non_blocking=True)
            out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            sampler.start += a.micro_batch

            if step % 10 == 0:
                loss = out.loss.detach().float()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / 10
                    tps = a.micro_batch * a.seq_len * world / dt
                    print(f"step {step} loss {loss.item():.4f} lr {lr_at(step, a):.2e} {tps:,.0f} tok/s")
                t0 = time.time()
            if step % a.eval_every == 0:
                vl = evaluate(model, val_loader)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}")
            if step % a.save_every == 0:
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg, osave_cfg):
                    msd = model.state_dict()
                    osd = FSDP.optim_state_dict(model, opt)
                if rank == 0:
                    torch.save({"model": msd, "optim": osd, "step": step, "epoch": epoch,
                                "global_samples_in_epoch": sampler.start * world}, ckpt_file + ".tmp")
                    os.replace(ckpt_file + ".tmp", ckpt_file)
                dist.barrier()
            if step >= a.max_steps:
                break
        else:
            epoch += 1
            sampler.start = 0

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
