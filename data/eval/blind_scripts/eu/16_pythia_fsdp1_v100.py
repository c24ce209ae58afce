"""Pythia-2.8B instruction tuning with FSDP1, portable across our GPU partitions.

--precision picks the FSDP mixed-precision policy: bf16 on the A100/H100
partitions, fp16 on the older V100 partition (no bf16 support there).

    # V100 partition, 4 nodes x 8 GPUs
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        16_pythia_fsdp1_v100.py --precision fp16 --data /gpfs/sft/dolly_oasst_tok
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

PRECISION = {
    "fp32": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
    "fp16": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16),
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="EleutherAI/pythia-2.8b-deduped")
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="/gpfs/ckpt/pythia-2.8b-sft")
    p.add_argument("--precision", choices=sorted(PRECISION), default="bf16")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=1000)
    return p.parse_args()


def pad_collate(pad_id):
    def fn(rows):
        L = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        att = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            lab[i, :n] = torch.tensor(r["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return fn


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.use_cache = False

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPTNeoXLayer}),
        mixed_precision=PRECISION[args.precision],
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        cpu_offload=CPUOffload(offload_params=True) if args.cpu_offload else None,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GPTNeoXLayer),
    )

    ds = load_from_disk(args.data)
    collate = pad_collate(tok.pad_token_id)
    sampler = DistributedSampler(ds["train"], shuffle=True, seed=11, drop_last=True)
    loader = DataLoader(ds["train"], batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(ds["validation"], batch_size=args.bs, collate_fn=collate, num_workers=2,
                            sampler=DistributedSampler(ds["validation"], shuffle=False))

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-6)
    total = args.epochs * len(loader)
    warm = int(args.warmup_frac * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / max(1, warm)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    step, start_epoch = 0, 0
    resume_dir = os.path.join(args.out, "latest")
    if os.path.exists(os.path.join(resume_dir, ".metadata")):
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "step": 0, "sched": sched.state_dict()["last_epoch"]}
        dcp.load(state, checkpoint_id=resume_dir)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["step"]
        sched.last_epoch = state["sched"]
        start_epoch = step // len(loader)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(loader):
            if epoch == start_epoch and i < step - start_epoch * len(loader):
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                stats = torch.stack([loss.detach().float(), gnorm.float().to(device)])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if is_main:
                    print(f"ep {epoch} step {step}/{total} loss {stats[0]:.4f} gnorm {stats[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / args.log_every:.2f}s/it",
                          flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, optim)
                dcp.save({"model": msd, "optim": osd, "step": step, "sched": sched.last_epoch},
                         checkpoint_id=os.path.join(args.out, f"step_{step}"))
                dist.barrier()
                if is_main:
                    if os.path.islink(resume_dir):
                        os.unlink(resume_dir)
                    os.symlink(f"step_{step}", resume_dir)

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                n = (batch["labels"][:, 1:] != -100).sum()
                tot += torch.stack([model(**batch).loss.float() * n, n.float()])
        dist.all_reduce(tot)
        if is_main:
            print(f"epoch {epoch} val_loss {(tot[0] / tot[1]).item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
