"""Domain adaptation of a Qwen2-1.5B checkpoint with FSDP2 (fully_shard per decoder layer).

Validation loss / perplexity go to TensorBoard and to metrics.jsonl; the eval
dashboard reads metrics.jsonl to pick the checkpoint to promote.

    torchrun --standalone --nproc_per_node=8 14_qwen_fsdp2_domain_adapt.py --train /data/med/train --val /data/med/val
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-1.5B")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="/data/runs/qwen2-1.5b-med")
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--steps", type=int, default=12000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--grad-ckpt", action="store_true")
    return p.parse_args()


def collate(rows):
    ids = torch.stack([torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows])
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def cosine(step, a):
    if step < a.warmup:
        return (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / (a.steps - a.warmup))
    return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def global_mean(t):
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=100):
    model.eval()
    loss_sum, n_tok = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        loss_sum += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        n_tok += y.numel()
    model.train()
    return loss_sum / max(n_tok, 1)


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    writer = None
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(a.out, "tb"))

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if a.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    train_ds = load_from_disk(a.train)
    val_ds = load_from_disk(a.val)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=a.mbs, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=a.mbs, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, a))

    step, epoch = 0, 0
    sampler.set_epoch(epoch)
    it = iter(train_loader)
    model.train()
    t0 = time.time()
    while step < a.steps:
        acc_loss = torch.zeros((), device=device)
        for micro in range(a.accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(train_loader)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.set_requires_gradient_sync(micro == a.accum - 1)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / a.accum
            loss.backward()
            acc_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 20 == 0:
            tl = global_mean(acc_loss)
            if rank == 0:
                dt = (time.time() - t0) / 20
                writer.add_scalar("train/loss", tl, step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"step {step} loss {tl:.4f} lr {sched.get_last_lr()[0]:.2e} {dt:.2f}s/step", flush=True)
            t0 = time.time()

        if step % a.eval_every == 0:
            val_loss = evaluate(model, val_loader, device)
            if rank == 0:
                ppl = math.exp(min(val_loss, 20))
                writer.add_scalar("val/loss", val_loss, step)
                writer.add_scalar("val/ppl", ppl, step)
                with open(os.path.join(a.out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "val_loss": val_loss, "val_ppl": ppl}) + "\n")
                print(f"[eval] step {step} val_loss {val_loss:.4f} ppl {ppl:.2f}", flush=True)

        if step % a.save_every == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(a.out, f"ckpt_{step:06d}"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
