"""
Continued pre-training of Qwen2-7B on a legal corpus with FSDP (SHARD_GRAD_OP + CPU offload
of parameters for the 40GB cards) and activation checkpointing. Token-weighted validation
perplexity is logged to W&B from rank 0 after every epoch.

    torchrun --nproc_per_node 8 13_fsdp_eval_ppl.py --train data/legal_train --val data/legal_val
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_from_disk
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2-7B")
    ap.add_argument("--train", required=True, help="dataset saved with save_to_disk, column input_ids")
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="ckpt/qwen2-legal")
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--eval_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--project", default="qwen2-legal-cpt")
    return ap.parse_args()


def causal_collate(tokenizer):
    pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64)

    def fn(features):
        batch = pad([{"input_ids": f["input_ids"]} for f in features])
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch

    return fn


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    nll_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_tok = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits[:, :-1].float()
        target = batch["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        nll_sum += nll.double()
        n_tok += (target != -100).sum().double()
    model.train()
    val_loss = (nll_sum / n_tok).item()
    return val_loss, math.exp(val_loss)


def main():
    args = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    if rank == 0:
        wandb.init(project=args.project, config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer}),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=args.offload),
        device_id=local_rank,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Qwen2DecoderLayer),
    )

    train_ds = load_from_disk(args.train)
    val_ds = load_from_disk(args.val)
    collate = causal_collate(tokenizer)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.eval_bs, sampler=val_sampler, collate_fn=collate,
                            num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total + 1,
                                                pct_start=0.03, anneal_strategy="cos")

    step = 0
    best_ppl = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last = (i + 1) % args.accum == 0
            if last:
                loss = model(**batch).loss / args.accum
                loss.backward()
                model.clip_grad_norm_(1.0)
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if rank == 0 and step % 10 == 0:
                    wandb.log({"train/loss": loss.item() * args.accum, "lr": sched.get_last_lr()[0],
                               "sec_per_step": (time.time() - t0) / 10}, step=step)
                    t0 = time.time()
            else:
                with model.no_sync():
                    loss = model(**batch).loss / args.accum
                    loss.backward()

        val_loss, ppl = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val_loss {val_loss:.4f} ppl {ppl:.2f}", flush=True)
            wandb.log({"val/loss": val_loss, "val/ppl": ppl, "epoch": epoch}, step=step)

        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        if rank == 0:
            path = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(path, exist_ok=True)
            torch.save(state, os.path.join(path, "model.pt"))
            tokenizer.save_pretrained(path)
            if ppl < best_ppl:
                best_ppl = ppl
                with open(os.path.join(args.out, "BEST"), "w") as f:
                    f.write(f"epoch{epoch}\t{ppl:.3f}\n")
        del state
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
