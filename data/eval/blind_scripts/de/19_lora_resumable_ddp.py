#!/usr/bin/env python
"""Resumable LoRA SFT (DDP) for long-running jobs on a preemptible partition.

Checkpoints (adapter + optimizer/scheduler/RNG state) go to --output_dir/checkpoint-<step>;
the newest one is picked up automatically on restart.

    torchrun --nproc_per_node 8 19_lora_resumable_ddp.py --train_file data/summ_train.jsonl \
        --eval_file data/summ_eval.jsonl --output_dir /shared/runs/llama2-summ-lora
"""
import argparse
import glob
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-chat-hf")
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--eval_file", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=3072)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save_every", type=int, default=200)
    ap.add_argument("--keep_last", type=int, default=3)
    ap.add_argument("--seed", type=int, default=99)
    return ap.parse_args()


def build_features(path, tok, max_len):
    feats = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            msgs = [{"role": "user", "content": f"Summarize the following document.\n\n{r['document']}"},
                    {"role": "assistant", "content": r["summary"]}]
            prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
            full = tok.apply_chat_template(msgs)
            if len(prompt) >= max_len:
                continue
            full = full[:max_len]
            feats.append({"input_ids": full, "labels": [-100] * len(prompt) + full[len(prompt):]})
    return feats


def collate(batch, pad_id):
    n = max(len(b["input_ids"]) for b in batch)
    return {
        "input_ids": torch.tensor([b["input_ids"] + [pad_id] * (n - len(b["input_ids"])) for b in batch]),
        "labels": torch.tensor([b["labels"] + [-100] * (n - len(b["labels"])) for b in batch]),
        "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (n - len(b["input_ids"])) for b in batch]),
    }


def latest_checkpoint(output_dir):
    ckpts = glob.glob(os.path.join(output_dir, "checkpoint-*"))
    ckpts = [c for c in ckpts if os.path.exists(os.path.join(c, "training_state.pt"))]
    if not ckpts:
        return None
    return max(ckpts, key=lambda c: int(re.search(r"checkpoint-(\d+)", c).group(1)))


def save_checkpoint(model, optimizer, scheduler, tok, step, epoch, args):
    ckpt_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
    os.makedirs(ckpt_dir, exist_ok=True)
    model.module.save_pretrained(ckpt_dir)
    tok.save_pretrained(ckpt_dir)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch": epoch, "torch_rng": torch.get_rng_state()},
               os.path.join(ckpt_dir, "training_state.pt"))
    old = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*")),
                 key=lambda c: int(re.search(r"checkpoint-(\d+)", c).group(1)))
    for c in old[: -args.keep_last]:
        shutil.rmtree(c, ignore_errors=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        tot += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token
    train = build_features(args.train_file, tok, args.max_len)
    evals = build_features(args.eval_file, tok, args.max_len)
    pad = tok.pad_token_id
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=lambda b: collate(b, pad),
                          num_workers=2, pin_memory=True)
    eval_dl = DataLoader(evals, batch_size=args.bs, sampler=DistributedSampler(evals, shuffle=False),
                         collate_fn=lambda b: collate(b, pad))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj", "k_proj", "o_proj"]))
    model.to(device)

    optimizer_params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(optimizer_params, lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(train_dl) // args.accum
    scheduler = get_linear_schedule_with_warmup(optimizer, 100, args.epochs * updates_per_epoch)

    step, start_epoch = 0, 0
    resume = latest_checkpoint(args.output_dir)
    if resume:
        set_peft_model_state_dict(model, load_file(os.path.join(resume, "adapter_model.safetensors"),
                                                   device=str(device)))
        state = torch.load(os.path.join(resume, "training_state.pt"), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, start_epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"resumed from {resume} at step {step}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = (step - epoch * updates_per_epoch) * args.accum if epoch == start_epoch else 0
        for i, b in enumerate(train_dl):
            if i < skip:
                continue
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = model(**b).loss
            (loss / args.accum).backward()
            if (i + 1) % args.accum:
                continue
            torch.nn.utils.clip_grad_norm_(optimizer_params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                          flush=True)
            if step % args.save_every == 0:
                ev = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {ev:.4f}", flush=True)
                save_checkpoint(model, optimizer, scheduler, tok, step, epoch, args)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
