#!/usr/bin/env python
# Continued pretraining of Mistral-7B-v0.3 on the filings + earnings-call corpus (~38B tokens,
# pre-tokenized and packed into uint32 memmaps by tools/pack_tokens.py).
#
# sbatch launch/cpt_mistral7b.sbatch  (p5.48xlarge, 8x H100 80GB, 2 TB host RAM per node):
#
#   #SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --exclusive
#   export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
#   export FI_PROVIDER=efa NCCL_PROTO=simple
#   srun --kill-on-bad-exit=1 torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 \
#        --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
#        cpt_fsdp.py --data /fsx/tokens/fin_v2 --out /fsx/ckpt/mistral7b-fin-cpt \
#        --export-every 2000
#
# Resumable checkpoints are DCP sharded; a consolidated HF-format copy is exported periodically
# for the eval harness (runs on a separate inference cluster).
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mistralai/Mistral-7B-v0.3")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--min-lr", type=float, default=3e-6)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--total-steps", type=int, default=9000)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--export-every", type=int, default=2000)
    return p.parse_args()


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(os.path.join(path, "tokens.u32"), dtype=np.uint32, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_lambda(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / (a.total_steps - a.warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))


def save_sharded(model, optim, step, out):
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)},
             checkpoint_id=os.path.join(out, f"dcp/step_{step}"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "dcp/latest"), "w") as f:
            f.write(str(step))


def load_sharded(model, optim, out):
    marker = os.path.join(out, "dcp/latest")
    if not os.path.exists(marker):
        return 0
    with open(marker) as f:
        step = int(f.read().strip())
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=os.path.join(out, f"dcp/step_{step}"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def export_consolidated(model, step, out):
    if dist.get_rank() == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            full_sd = model.state_dict()
        dst = os.path.join(out, f"hf/step_{step}")
        model.module.save_pretrained(dst, state_dict=full_sd, safe_serialization=True)
        print(f"exported consolidated weights to {dst}", flush=True)
    dist.barrier()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(os.path.join(a.out, "dcp"), exist_ok=True)
        os.makedirs(os.path.join(a.out, "hf"), exist_ok=True)
    dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16,
                                                 low_cpu_mem_usage=True,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={MistralDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=local_rank,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)

    ds = PackedTokens(a.data, a.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1337, drop_last=True)
    loader = DataLoader(ds, batch_size=a.micro_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    micro_per_epoch = len(loader)

    step = load_sharded(model, optim, a.out)
    micro_done = step * a.accum
    epoch = micro_done // micro_per_epoch
    skip = micro_done % micro_per_epoch

    writer = SummaryWriter(os.path.join(a.out, "tb")) if rank == 0 else None
    if rank == 0:
        print(f"world={world} resume_step={step} epoch={epoch} skip={skip}", flush=True)

    model.train()
    t0 = time.time()
    while step < a.total_steps:
        sampler.set_epoch(epoch)
        running = torch.zeros(1, device="cuda")
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / a.accum).backward()
            running += loss.detach() / a.accum
            if (i + 1) % a.accum != 0:
                continue
            for g in optim.param_groups:
                g["lr"] = lr_lambda(step, a)
            gnorm = model.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if writer is not None:
                    tps = 10 * a.accum * a.micro_batch * a.seq_len * world / (time.time() - t0)
                    writer.add_scalar("train/loss", running.item(), step)
                    writer.add_scalar("train/grad_norm", gnorm.item(), step)
                    writer.add_scalar("train/lr", optim.param_groups[0]["lr"], step)
                    writer.add_scalar("perf/tokens_per_sec", tps, step)
                t0 = time.time()
            running.zero_()
            if step % a.save_every == 0:
                save_sharded(model, optim, step, a.out)
            if step % a.export_every == 0:
                export_consolidated(model, step, a.out)
            if step >= a.total_steps:
                break
        skip = 0
        epoch += 1

    save_sharded(model, optim, step, a.out)
    export_consolidated(model, step, a.out)
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
