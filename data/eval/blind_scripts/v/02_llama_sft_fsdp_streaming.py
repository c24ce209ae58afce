# Supervised fine-tuning of Llama-3.1-8B on the internal instruction mix (MDS shards in S3).
#
# Slurm (2 nodes x 8 H100), one torchrun per node:
#
#   #SBATCH --nodes=2
#   #SBATCH --ntasks-per-node=1
#   #SBATCH --gpus-per-node=8
#   #SBATCH --cpus-per-task=96
#   export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
#   export MASTER_PORT=29500
#   srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
#       --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
#       sft_fsdp.py --remote s3://ml-data/sft/mix-v7/mds --local /scratch/mds-cache \
#       --out /fsx/ckpt/llama8b-sft-v7
#
# Mosaic StreamingDataset reads RANK / WORLD_SIZE / LOCAL_WORLD_SIZE from the env torchrun sets
# and partitions samples across ranks and dataloader workers itself.
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from streaming import StreamingDataLoader, StreamingDataset
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
import wandb

IGNORE = -100


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--remote", required=True)
    ap.add_argument("--local", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-bs", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--log-every", type=int, default=10)
    return ap.parse_args()


def collate(batch, pad_id, seq_len):
    ids = torch.full((len(batch), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), seq_len), IGNORE, dtype=torch.long)
    for i, s in enumerate(batch):
        toks = torch.as_tensor(s["input_ids"][:seq_len], dtype=torch.long)
        mask = torch.as_tensor(s["loss_mask"][:seq_len], dtype=torch.bool)
        ids[i, : len(toks)] = toks
        labels[i, : len(toks)] = torch.where(mask, toks, torch.full_like(toks, IGNORE))
    return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad_id)}


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def save_resumable(model, optim, loader, step, out):
    path = os.path.join(out, f"step_{step:06d}")
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    loader_state = loader.state_dict()
    if dist.get_rank() == 0:
        torch.save(loader_state, os.path.join(path, "loader.pt"))
        with open(os.path.join(out, "latest.json"), "w") as f:
            json.dump({"step": step, "path": path}, f)
    dist.barrier()


def try_resume(model, optim, loader, out):
    meta = os.path.join(out, "latest.json")
    if not os.path.exists(meta):
        return 0
    with open(meta) as f:
        info = json.load(f)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=info["path"])
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loader.load_state_dict(torch.load(os.path.join(info["path"], "loader.pt"), map_location="cpu"))
    return info["step"]


def export_hf(model, tokenizer, out):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        full = model.state_dict()
    if dist.get_rank() == 0:
        final = os.path.join(out, "hf")
        model.module.save_pretrained(final, state_dict=full, safe_serialization=True)
        tokenizer.save_pretrained(final)
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    # rank 0 materialises the weights, the rest start on meta and receive them via sync_module_states
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                     attn_implementation="flash_attention_2")
    else:
        cfg = AutoConfig.from_pretrained(args.model, attn_implementation="flash_attention_2")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False)) if rank != 0 else None,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)

    ds = StreamingDataset(remote=args.remote, local=args.local, shuffle=True, shuffle_seed=17,
                          batch_size=args.micro_bs, predownload=8 * args.micro_bs)
    loader = StreamingDataLoader(ds, batch_size=args.micro_bs, num_workers=8, pin_memory=True,
                                 collate_fn=functools.partial(collate, pad_id=pad_id, seq_len=args.seq_len),
                                 drop_last=True, persistent_workers=True)

    step = try_resume(model, optim, loader, args.out)
    if rank == 0:
        wandb.init(project="llm-sft", name=os.path.basename(args.out), config=vars(args), resume="allow")
        print(f"world={world} start_step={step} tokens/step={args.seq_len * args.micro_bs * args.grad_accum * world:,}")

    model.train()
    it = iter(loader)
    t0 = time.time()
    while step < args.max_steps:
        for g in optim.param_groups:
            g["lr"] = lr_at(step, args)
        tok_count = torch.zeros(1, device="cuda")
        loss_acc = torch.zeros(1, device="cuda")
        micro = []
        for _ in range(args.grad_accum):
            try:
                micro.append(next(it))
            except StopIteration:
                it = iter(loader)
                micro.append(next(it))
        # normalise by the number of supervised tokens in the whole global batch
        n_tok = torch.tensor([sum((b["labels"][:, 1:] != IGNORE).sum().item() for b in micro)],
                             device="cuda", dtype=torch.float32)
        dist.all_reduce(n_tok)
        for i, b in enumerate(micro):
            b = {k: v.cuda(non_blocking=True) for k, v in b.items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss_sum = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), b["labels"][:, 1:].flatten(),
                ignore_index=IGNORE, reduction="sum")
            # FSDP averages grads over ranks, so scale by world / global token count
            (loss_sum * world / n_tok).backward()
            loss_acc += loss_sum.detach()
        gnorm = model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % args.log_every == 0:
            dist.all_reduce(loss_acc)
            if rank == 0:
                dt = time.time() - t0
                t0 = time.time()
                wandb.log({"loss": (loss_acc / n_tok).item(), "grad_norm": gnorm.item(),
                           "lr": optim.param_groups[0]["lr"], "sec_per_step": dt / args.log_every}, step=step)
        if step % args.save_every == 0:
            save_resumable(model, optim, loader, step, args.out)

    export_hf(model, tok, args.out)
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
