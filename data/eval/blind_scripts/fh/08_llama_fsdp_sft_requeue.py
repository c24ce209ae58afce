#!/usr/bin/env python
"""Supervised fine-tuning of a Llama-style 7B model with FSDP.

Submit with:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=48
    #SBATCH --mem=0
    #SBATCH --signal=USR1@300
    #SBATCH --requeue

    nodes=( $(scontrol show hostnames $SLURM_JOB_NODELIST) )
    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=4 \
        --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d --rdzv-endpoint=${nodes[0]}:29502 \
        llama_sft.py --model /proj/llm/weights/llama-7b-hf --data /proj/llm/sft/mix_v2.jsonl \
        --out /proj/llm/runs/sft_7b

Only rank 0 reads the pretrained weights from disk; the other ranks build the
model on the meta device and receive the weights through sync_module_states.
Interrupted runs keep a sharded (torch.distributed.checkpoint) checkpoint
that can be resumed on a different number of nodes.
"""
import argparse
import functools
import json
import os
import signal
import subprocess

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

_USR1 = False


def _sig(signum, frame):
    global _USR1
    _USR1 = True


class SFTData(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = self.tok(r["prompt"], add_special_tokens=True)["input_ids"]
        answer = self.tok(r["response"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt + answer)[: self.max_len]
        labels = ([-100] * len(prompt) + answer)[: self.max_len]
        pad = self.max_len - len(ids)
        return (torch.tensor(ids + [self.tok.pad_token_id] * pad),
                torch.tensor(labels + [-100] * pad),
                torch.tensor([1] * len(ids) + [0] * pad))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--micro-bs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    return p.parse_args()


def main():
    args = parse()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    signal.signal(signal.SIGUSR1, _sig)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token
    ds = SFTData(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    else:
        cfg = AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.config.use_cache = False

    def to_empty(m):
        m.to_empty(device=torch.cuda.current_device(), recurse=False)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=None if rank == 0 else to_empty,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer))

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(loader)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / 100) * max(0.0, 1 - s / total))

    shard_dir = os.path.join(args.out, "sharded")
    meta_file = os.path.join(args.out, "progress.json")
    step = 0
    if os.path.exists(meta_file):
        with open(meta_file) as f:
            step = json.load(f)["step"]
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=shard_dir)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for _ in range(step):
            sched.step()
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    def save_sharded():
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=shard_dir)
        dist.barrier()
        if rank == 0:
            with open(meta_file, "w") as f:
                json.dump({"step": step, "world_size": world}, f)

    model.train()
    stop = False
    while step < total and not stop:
        epoch = step // steps_per_epoch
        sampler.set_epoch(epoch)
        skip = step % steps_per_epoch
        for i, (ids, labels, mask) in enumerate(loader):
            if i < skip:
                continue
            ids, labels, mask = ids.cuda(), labels.cuda(), mask.cuda()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                stats = torch.tensor([loss.item(), float(_USR1)], device="cuda")
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                if rank == 0:
                    print(f"step {step}/{total} loss(max over ranks) {stats[0].item():.4f}",
                          flush=True)
                if stats[1].item() > 0:
                    stop = True
                    break

    save_sharded()
    if stop:
        if rank == 0:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
    else:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            full = model.state_dict()
        if rank == 0:
            final = os.path.join(args.out, "final")
            model.module.save_pretrained(final, state_dict=full, safe_serialization=True)
            tok.save_pretrained(final)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
