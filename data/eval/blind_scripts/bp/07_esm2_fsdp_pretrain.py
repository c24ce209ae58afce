"""ESM-2 (650M config) masked-LM pretraining with FSDP, bf16, on UniRef50 parquet.

Checkpoints: a full (consolidated) model state on rank 0 for export, plus the full
optimizer state so the run can be resumed on any number of GPUs.

    torchrun --nnodes=$NNODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        07_esm2_fsdp_pretrain.py --data /lustre/uniref50 --out /lustre/runs/esm2_650m
"""
import argparse
import functools
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import DataCollatorForLanguageModeling, EsmConfig, EsmForMaskedLM, EsmTokenizer
from transformers.models.esm.modeling_esm import EsmLayer


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.parquet / valid.parquet")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="facebook/esm2_t33_650M_UR50D")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=500000)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--eval_every", type=int, default=1000)
    return ap.parse_args()


class SeqTable(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.seqs = pd.read_parquet(path, columns=["sequence"])["sequence"].tolist()
        self.tok, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.tok(self.seqs[i], truncation=True, max_length=self.max_len)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * max(0.1, 1.0 - (step - args.warmup) / (args.steps - args.warmup))


def save_checkpoint(model, opt, step, args, rank):
    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, optim_cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        path = os.path.join(args.out, f"step{step:07d}.pt")
        torch.save({"model": model_state, "optim": optim_state, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def load_checkpoint(model, opt, args):
    ckpts = sorted(f for f in os.listdir(args.out) if f.startswith("step") and f.endswith(".pt"))
    if not ckpts:
        return 0
    ck = torch.load(os.path.join(args.out, ckpts[-1]), map_location="cpu")
    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg, optim_cfg):
        model.load_state_dict(ck["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
    return ck["step"]


@torch.no_grad()
def evaluate(model, loader, device, limit=100):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if i == limit:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"] != -100).sum()
        acc += torch.stack([out.loss.double() * n, n.double()])
    dist.all_reduce(acc)
    model.train()
    return math.exp(acc[0].item() / acc[1].item())


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15, pad_to_multiple_of=8)
    train_ds = SeqTable(os.path.join(args.data, "train.parquet"), tok, args.max_len)
    valid_ds = SeqTable(os.path.join(args.data, "valid.parquet"), tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                        num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, collate_fn=collator, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True))

    config = EsmConfig.from_pretrained(args.tokenizer)
    model = EsmForMaskedLM(config)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EsmLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True, limit_all_gathers=True)
    # optimizer is built on the FSDP-wrapped (sharded) parameters
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    step = load_checkpoint(model, opt, args)
    if rank == 0:
        print(f"world {world}, starting at step {step}", flush=True)

    epoch = step * args.batch_size * world // len(train_ds)
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {50 / (time.time() - t0):.2f} it/s", flush=True)
                    t0 = time.time()
            if step % args.eval_every == 0:
                ppl = evaluate(model, valid_loader, device)
                if rank == 0:
                    print(f"step {step} valid ppl {ppl:.3f}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint(model, opt, step, args, rank)
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
