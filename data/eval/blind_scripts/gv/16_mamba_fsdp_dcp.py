"""
Mamba 2.8B continued pretraining at 16k context with FSDP, sharded (DCP) checkpoints
for resumption and a consolidated state dict for export.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        16_mamba_fsdp_dcp.py --data /lustre/tok/slimpj_16k.u32 --ckpt_dir /lustre/ckpt/mamba2.8b_16k
"""
import argparse
import functools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
from mamba_ssm.modules.block import Block


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default="state-spaces/mamba-2.8b")
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--micro_bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--save_every", type=int, default=500)
    return ap.parse_args()


class Packed(Dataset):
    def __init__(self, path, L):
        self.tok = np.memmap(path, dtype=np.uint32, mode="r")
        self.L = L

    def __len__(self):
        return (len(self.tok) - 1) // self.L

    def __getitem__(self, i):
        return torch.from_numpy(self.tok[i * self.L:(i + 1) * self.L + 1].astype(np.int64))


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / (args.steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def save_sharded(model, opt, step, ckpt_dir, rank):
    path = os.path.join(ckpt_dir, f"step_{step:06d}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest.json"), "w") as f:
            json.dump({"step": step, "path": path}, f)
    dist.barrier()


def maybe_load_sharded(model, opt, ckpt_dir):
    meta_path = os.path.join(ckpt_dir, "latest.json")
    if not os.path.exists(meta_path):
        return 0
    with open(meta_path) as f:
        meta = json.load(f)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    # DCP reshards on load, so the job may come back with a different node count
    dcp.load(state, checkpoint_id=meta["path"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta["step"]


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # every rank loads the fp32 weights on CPU, FSDP shards them onto the GPU
    model = MambaLMHeadModel.from_pretrained(args.init, device="cpu", dtype=torch.float32)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sync_module_states=False, limit_all_gathers=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    step = maybe_load_sharded(model, opt, args.ckpt_dir)

    ds = Packed(args.data, args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    batches_per_epoch = len(loader)
    epoch, skip = divmod(step, batches_per_epoch)
    if rank == 0:
        print(f"world {world}, {batches_per_epoch} batches/epoch, starting at step {step}", flush=True)

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, seq in enumerate(loader):
            if i < skip:
                continue
            seq = seq.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            logits = model(seq[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.3f} lr {lr_at(step, args):.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                save_sharded(model, opt, step, args.ckpt_dir, rank)
            if step >= args.steps:
                break
        skip = 0
        epoch += 1

    # consolidated weights for inference; every rank takes part in the gather
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full_sd, os.path.join(args.ckpt_dir, "pytorch_model.bin"))
        with open(os.path.join(args.ckpt_dir, "config.json"), "w") as f:
            json.dump(vars(model.module.config), f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
