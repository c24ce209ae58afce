"""Multi-epoch SFT of SmolLM2-1.7B on an internal tool-use dataset with FSDP2.

The dataset is small (~60k conversations), so we run several epochs over it.

    torchrun --standalone --nproc_per_node=8 19_smollm_fsdp2_multiepoch_sft.py --data /data/tooluse/v3_tok
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-1.7B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/data/ckpt/smollm2-tooluse")
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup-ratio", type=float, default=0.05)
    return ap.parse_args()


class Collator:
    def __init__(self, pad_id, max_len):
        self.pad_id, self.max_len = pad_id, max_len

    def __call__(self, rows):
        rows = [{k: r[k][: self.max_len] for k in ("input_ids", "labels")} for r in rows]
        L = max(len(r["input_ids"]) for r in rows)
        L = (L + 63) // 64 * 64
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        att = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            lab[i, :n] = torch.tensor(r["labels"])
            att[i, :n] = 1
        return ids, lab, att


def token_loss(logits, labels):
    """Sum of per-token CE and number of supervised tokens (shifted)."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, (labels != -100).sum()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    ds = load_from_disk(args.data)
    collate = Collator(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, args.max_len)
    sampler = DistributedSampler(ds["train"], num_replicas=world, rank=rank, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(ds["train"], batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(ds["validation"], batch_size=args.bs, collate_fn=collate, num_workers=2,
                            sampler=DistributedSampler(ds["validation"], num_replicas=world, rank=rank,
                                                       shuffle=False))

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(loader) // args.accum
    total = steps_per_epoch * args.epochs
    warm = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / max(1, warm) if s < warm
        else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))

    if rank == 0:
        print(f"train={len(ds['train'])} world={world} steps/epoch={steps_per_epoch} total={total}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for i, (ids, lab, att) in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break
            ids, lab, att = ids.to(device, non_blocking=True), lab.to(device, non_blocking=True), att.to(device)
            last_micro = (i + 1) % args.accum == 0
            model.set_requires_gradient_sync(last_micro)
            logits = model(input_ids=ids, attention_mask=att).logits
            loss_sum, ntok = token_loss(logits, lab)
            (loss_sum / ntok.clamp(min=1) / args.accum).backward()
            run += torch.stack([loss_sum.detach(), ntok.float()])
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {(run[0] / run[1]).item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/step", flush=True)
                run.zero_()
                t0 = time.time()

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, lab, att in val_loader:
                ids, lab, att = ids.to(device), lab.to(device), att.to(device)
                ls, nt = token_loss(model(input_ids=ids, attention_mask=att).logits, lab)
                tot += torch.stack([ls, nt.float()])
        dist.all_reduce(tot)
        if rank == 0:
            vl = (tot[0] / tot[1]).item()
            print(f"epoch {epoch} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"epoch_{epoch}"))

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "hf"), state_dict=full, safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
