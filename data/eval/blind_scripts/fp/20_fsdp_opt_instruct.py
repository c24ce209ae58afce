"""Instruction tuning of OPT-2.7B with FSDP on a single 8-GPU spot node.

    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 20_fsdp_opt_instruct.py \
        --train /data/instruct/train.jsonl --out /shared/opt27b-instruct

The checkpoint is a consolidated (unsharded) state dict, so it can be loaded
into a plain `OPTForCausalLM` for evaluation and for resuming.
"""
import argparse
import functools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, OPTForCausalLM
from transformers.models.opt.modeling_opt import OPTDecoderLayer

SIGTERM_RECEIVED = False


def _on_sigterm(signum, frame):
    global SIGTERM_RECEIVED
    SIGTERM_RECEIVED = True


class InstructJsonl(Dataset):
    def __init__(self, path, tok, max_len=1024):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f if l.strip()]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = f"Instruction: {r['instruction']}\n" + (f"Input: {r['input']}\n" if r.get("input") else "") + "Output: "
        p = self.tok(prompt, add_special_tokens=True)["input_ids"]
        o = self.tok(r["output"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + o)[: self.max_len]
        lab = ([-100] * len(p) + o)[: self.max_len]
        return ids, lab


def collate(batch, pad_id):
    L = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), -100)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="facebook/opt-2.7b")
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5, help="global batch 8 x 4 = 32")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-steps", type=int, default=300)
    return p.parse_args()


def save_checkpoint(model, optimizer, scheduler, meta, out, rank):
    path = os.path.join(out, "checkpoint.pt")
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        os.makedirs(out, exist_ok=True)
        torch.save({"model": model_state, "optim": optim_state, "sched": scheduler.state_dict(), **meta},
                   path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    args = args_parser()
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = OPTForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    ckpt = torch.load(ckpt_path, map_location="cpu", mmap=True) if os.path.exists(ckpt_path) else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])  # full weights into the unwrapped model

    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={OPTDecoderLayer}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.bfloat16),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 device_id=local_rank,
                 use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    ds = InstructJsonl(args.train, tok)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2,
                        collate_fn=functools.partial(collate, pad_id=tok.pad_token_id))
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100) * (1 - s / total))

    start_epoch, start_batch, step = 0, 0, 0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optim"]))
        scheduler.load_state_dict(ckpt["sched"])
        start_epoch, start_batch, step = ckpt["epoch"], ckpt["batch"], ckpt["step"]
        del ckpt
        if rank == 0:
            print(f"resumed at epoch {start_epoch} batch {start_batch} (step {step})", flush=True)

    model.train()
    stop = torch.zeros(1, device=local_rank)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for b, batch in enumerate(loader):
            if epoch == start_epoch and b < start_batch:
                continue
            batch = {k: v.to(local_rank, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                rl = loss.detach().float()
                dist.all_reduce(rl, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {rl.item():.4f} "
                          f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
                    t0 = time.time()

            stop[0] = float(SIGTERM_RECEIVED)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or step % args.save_steps == 0:
                save_checkpoint(model, optimizer, scheduler, {"epoch": epoch, "batch": b + 1, "step": step},
                                args.out, rank)
            if stop.item():
                break
        if stop.item():
            if rank == 0:
                print("preempted; checkpoint saved", flush=True)
            break
        save_checkpoint(model, optimizer, scheduler, {"epoch": epoch + 1, "batch": 0, "step": step}, args.out, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
