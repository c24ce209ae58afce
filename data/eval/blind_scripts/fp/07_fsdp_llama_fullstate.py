"""FSDP continued pretraining of TinyLlama-1.1B on packed token blocks.

    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29400 \
        07_fsdp_llama_fullstate.py --data /fsx/tokens/train.npy --out /fsx/runs/tinyllama-cpt

Checkpoints are consolidated (full, unsharded) so they are independent of the
number of ranks and can be loaded by plain HF code for evaluation.
"""
import argparse
import functools
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

SHOULD_STOP = False


def _sig(signum, frame):
    global SHOULD_STOP
    SHOULD_STOP = True


class PackedBlocks(Dataset):
    def __init__(self, path):
        self.blocks = np.load(path, mmap_mode="r")  # [n_blocks, seq_len + 1] int32

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, i):
        row = torch.from_numpy(np.asarray(self.blocks[i], dtype=np.int64))
        return row[:-1], row[1:]


class SkipSampler(DistributedSampler):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return self.num_samples - self.skip


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4, help="16 ranks x 4 = 64 blocks per step")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def save(model, optimizer, scheduler, meta, out_dir, rank):
    model_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "ckpt.pt")
        torch.save({"model": model_sd, "optim": optim_sd, "sched": scheduler.state_dict(), **meta},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load(model, optimizer, scheduler, out_dir):
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return None
    ckpt = torch.load(path, map_location="cpu", mmap=True)
    model_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
        model.load_state_dict(ckpt["model"])
        osd = FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optim"])
    optimizer.load_state_dict(osd)
    scheduler.load_state_dict(ckpt["sched"])
    return {k: ckpt[k] for k in ("step", "epoch", "seen_in_epoch")}


def main():
    args = parse()
    signal.signal(signal.SIGTERM, _sig)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.use_cache = False
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / args.steps))

    ds = PackedBlocks(args.data)
    sampler = SkipSampler(ds, shuffle=True, seed=args.seed, drop_last=True)

    step, epoch, seen_in_epoch = 0, 0, 0
    meta = load(model, optimizer, scheduler, args.out)
    if meta is not None:
        step, epoch, seen_in_epoch = meta["step"], meta["epoch"], meta["seen_in_epoch"]
        if rank == 0:
            print(f"resumed: step {step} epoch {epoch} samples {seen_in_epoch}", flush=True)

    stop = torch.zeros(1, device="cuda")
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        sampler.skip = seen_in_epoch
        loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2,
                            pin_memory=True, drop_last=True)
        t0 = time.time()
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seen_in_epoch += x.size(0)

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
                    t0 = time.time()

            stop[0] = float(SHOULD_STOP)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            meta = {"step": step, "epoch": epoch, "seen_in_epoch": seen_in_epoch}
            if stop.item() or step % args.save_every == 0 or step == args.steps:
                save(model, optimizer, scheduler, meta, args.out, rank)
            if stop.item() or step == args.steps:
                break
        if stop.item():
            if rank == 0:
                print(f"preempted, state saved at step {step}", flush=True)
            break
        if step < args.steps:
            epoch += 1
            seen_in_epoch = 0

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
