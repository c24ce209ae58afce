"""
FSDP + CPU offload fine-tuning of falcon-7b on a folder of raw .txt files.

Tokenising the corpus takes ~20 minutes, so the packed token tensor is cached next to the data
and reused by later runs.

    torchrun --nproc_per_node 4 17_fsdp_tokenize_cache.py --data_dir /mnt/shared/corpus --out /mnt/shared/runs/falcon
"""
import argparse
import functools
import glob
import hashlib
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
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiiuae/falcon-7b")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="runs/falcon")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--overwrite_cache", action="store_true")
    return ap.parse_args()


def cache_path(data_dir, model_name, seq_len):
    files = sorted(glob.glob(os.path.join(data_dir, "**", "*.txt"), recursive=True))
    h = hashlib.md5(("|".join(files) + model_name + str(seq_len)).encode()).hexdigest()[:10]
    return os.path.join(data_dir, f".cache_tokens_{h}.pt"), files


def build_blocks(data_dir, tokenizer, model_name, seq_len, overwrite):
    path, files = cache_path(data_dir, model_name, seq_len)
    if os.path.exists(path) and not overwrite:
        return torch.load(path)
    ids = []
    for fn in files:
        with open(fn, encoding="utf-8", errors="ignore") as f:
            ids.extend(tokenizer(f.read())["input_ids"])
            ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    blocks = torch.tensor(ids[: n * seq_len], dtype=torch.int32).view(n, seq_len)
    torch.save(blocks, path)
    return blocks


def warmup_cosine(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tok = AutoTokenizer.from_pretrained(args.model)
    blocks = build_blocks(args.data_dir, tok, args.model, args.seq_len, args.overwrite_cache)
    if rank == 0:
        print(f"{blocks.shape[0]} blocks of {args.seq_len} tokens", flush=True)

    dataset = TensorDataset(blocks)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={FalconDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, FalconDecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(loader) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, args.warmup, total))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        t0 = time.time()
        for i, (x,) in enumerate(loader):
            x = x.long().to(device, non_blocking=True)
            update = (i + 1) % args.accum == 0
            if update:
                loss = model(input_ids=x, labels=x).loss / args.accum
                loss.backward()
                model.clip_grad_norm_(1.0)
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
            else:
                with model.no_sync():
                    loss = model(input_ids=x, labels=x).loss / args.accum
                    loss.backward()
            acc[0] += loss.detach().float() * args.accum
            acc[1] += 1
            if update and step % 20 == 0:
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"step {step}/{total} loss {(acc[0] / acc[1]).item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.1f}s/step", flush=True)
                acc.zero_()
                t0 = time.time()

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = model.state_dict()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(sd, os.path.join(args.out, f"falcon_epoch{epoch}.pt"))
        del sd
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
