#!/usr/bin/env python3
"""LoRA supervised fine-tuning of a causal LM, wrapped in a restartable job.

    python 14_torchrun_job_lora_sft.py --base meta-llama/Llama-3.2-1B --data data/sft.jsonl --out runs/lora_sft

Job mode (default) runs torchrun on this file with one process per visible
GPU and retries on failure; torchrun writes per-rank logs to <out>/logs/.
`--stage train` is the worker entry point (data-parallel DDP over LoRA params).
"""
import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict, get_peft_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["job", "train"], default="job")
    p.add_argument("--max-tries", type=int, default=3)
    p.add_argument("--port", type=int, default=29620)
    p.add_argument("--base", default="meta-llama/Llama-3.2-1B")
    p.add_argument("--data", default="data/sft.jsonl")
    p.add_argument("--out", default="runs/lora_sft")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--save-every", type=int, default=200)
    return p.parse_args()


class SFTData(Dataset):
    """jsonl rows {"prompt": ..., "response": ...}; loss only on the response tokens."""

    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                p_ids = tok(row["prompt"], add_special_tokens=True)["input_ids"]
                r_ids = tok(row["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
                ids = (p_ids + r_ids)[:max_len]
                labels = ([-100] * len(p_ids) + r_ids)[:max_len]
                self.items.append((ids, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_batch(batch, pad_id):
    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (a, b) in enumerate(batch):
        ids[i, :len(a)] = torch.tensor(a)
        labels[i, :len(b)] = torch.tensor(b)
        mask[i, :len(a)] = 1
    return ids, mask, labels


def train(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    data = SFTData(args.data, tok, args.max_len)
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True,
                        collate_fn=functools.partial(pad_batch, pad_id=tok.pad_token_id), num_workers=2)
    accum = max(1, args.global_batch // (args.micro_batch * world))

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"],
                                             task_type="CAUSAL_LM"))
    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    updates = args.epochs * (len(loader) // accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: min(1.0, (u + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(u, updates) / updates)))

    update, start_epoch = 0, 0
    state_path = os.path.join(args.out, "state.pt")
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location="cpu")
        set_peft_model_state_dict(model, st["lora"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        update, start_epoch = st["update"], st["epoch"]
    ddp = DDP(model, device_ids=[local_rank])
    if rank == 0:
        print(f"world={world} accum={accum} updates={updates} resume_update={update}", flush=True)

    def save(epoch):
        if rank == 0:
            st = {"lora": get_peft_model_state_dict(model), "opt": opt.state_dict(),
                  "sched": sched.state_dict(), "update": update, "epoch": epoch}
            torch.save(st, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
            model.save_pretrained(os.path.join(args.out, "adapter"))
        dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = update * accum - epoch * (len(loader) // accum) * accum if epoch == start_epoch else 0
        t0 = time.time()
        for i, (ids, mask, labels) in enumerate(loader):
            if i < skip:
                continue
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            sync = (i + 1) % accum == 0
            ddp.require_backward_grad_sync = sync
            loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss / accum
            loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 10 == 0:
                print(f"epoch {epoch} update {update}/{updates} loss {loss.item() * accum:.4f} "
                      f"{(time.time() - t0) / 10:.2f}s/update", flush=True)
                t0 = time.time()
            if update % args.save_every == 0:
                save(epoch)
        save(epoch + 1)

    dist.destroy_process_group()


def visible_gpus():
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    return [g for g in ids.split(",") if g.strip()]


def job(args):
    os.makedirs(args.out, exist_ok=True)
    nproc = len(visible_gpus())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={args.port}",
           f"--log-dir={os.path.join(args.out, 'logs')}", "--redirects=3", "--tee=3",
           os.path.abspath(__file__), *sys.argv[1:], "--stage", "train"]
    for attempt in range(1, args.max_tries + 1):
        print(f"[job] try {attempt}/{args.max_tries} with {nproc} processes", flush=True)
        proc = subprocess.run(cmd)
        if proc.returncode == 0:
            print("[job] done", flush=True)
            return 0
        print(f"[job] torchrun exited with {proc.returncode}", flush=True)
        time.sleep(30)
    return 1


if __name__ == "__main__":
    a = get_args()
    if a.stage == "train":
        train(a)
    else:
        sys.exit(job(a))
