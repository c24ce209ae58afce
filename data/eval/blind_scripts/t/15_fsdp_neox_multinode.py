"""
Multi-node FSDP pretraining of a 1.4B GPT-NeoX model (Pythia-1.4B config,
random init) on a pre-tokenized, packed dataset saved with `save_to_disk`.

Slurm batch script used on the cluster (4 nodes x 8 H100):

    #!/bin/bash
    #SBATCH --job-name=neox-1.4b
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=12
    #SBATCH --time=48:00:00
    #SBATCH --output=logs/%x-%j.out

    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29500
    export NCCL_IB_HCA=mlx5
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
        15_fsdp_neox_multinode.py --data /lustre/datasets/pile_dedup_packed_2048 --out /lustre/ckpt/neox1b4
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from datasets import load_from_disk
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, GPTNeoXForCausalLM
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config_name", default="EleutherAI/pythia-1.4b")
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=1430)
    p.add_argument("--max_steps", type=int, default=143000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--save_every", type=int, default=2000)
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = AutoConfig.from_pretrained(args.config_name)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPTNeoXLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (args.max_steps - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    data = load_from_disk(args.data).with_format("torch")
    train, val = data["train"], data["validation"]
    sampler = DistributedSampler(train, shuffle=True, seed=1234, drop_last=True)
    dl = DataLoader(train, batch_size=args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True,
                    persistent_workers=True)
    val_dl = DataLoader(val, batch_size=args.micro_bs,
                        sampler=DistributedSampler(val, shuffle=False, drop_last=True), num_workers=2)

    step = 0
    ckpt_dir = os.path.join(args.out, "sharded")
    tracker = os.path.join(args.out, "latest_step.txt")
    if os.path.exists(tracker):
        step = int(open(tracker).read())
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))
            model.load_state_dict(state["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
        for _ in range(step):
            sched.step()
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    def evaluate():
        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for i, batch in enumerate(val_dl):
                if i == 50:
                    break
                ids = batch["input_ids"].cuda(non_blocking=True)
                out = model(input_ids=ids, labels=ids)
                tot += torch.stack([out.loss.float() * ids.numel(), torch.tensor(float(ids.numel()), device="cuda")])
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item()

    model.train()
    epoch = step // len(dl)
    sampler.set_epoch(epoch)
    it = iter(dl)
    for _ in range(step % len(dl)):
        next(it)
    t0 = time.time()
    while step < args.max_steps:
        try:
            batch = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(dl)
            batch = next(it)
        ids = batch["input_ids"].cuda(non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        gnorm = model.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 50 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 50
                t0 = time.time()
                tok_s = args.micro_bs * ids.shape[1] * world / dt
                print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{tok_s / 1e6:.2f}M tok/s", flush=True)

        if step % args.eval_every == 0:
            vl = evaluate()
            if rank == 0:
                print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        if step % args.save_every == 0:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
                dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))
            dist.barrier()
            if rank == 0:
                with open(tracker, "w") as f:
                    f.write(str(step))

    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg):
        full = model.state_dict()
    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final_hf"), state_dict=full, safe_serialization=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
