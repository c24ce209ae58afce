"""Supervised fine-tuning of a small decoder LM as a Kubeflow PyTorchJob.

The training operator gives every pod MASTER_ADDR / MASTER_PORT and sets
WORLD_SIZE and RANK to the number of pods and the pod's index (one pod per node,
8 GPUs each, elasticPolicy off). This file turns that into a torchrun call
(`entrypoint`), and torchrun runs `train` in one process per GPU.

Container args: ["python", "/opt/sft/sft_job.py", "entrypoint", "--config", "/etc/sft/config.json"]
The run id comes from the job's RUN_ID env so restarts append to the same W&B run.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def entrypoint(config_path):
    nnodes = os.environ["WORLD_SIZE"]
    node_rank = os.environ["RANK"]
    gpus = os.environ.get("GPUS_PER_POD", str(torch.cuda.device_count()))
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", nnodes, "--node_rank", node_rank, "--nproc_per_node", gpus,
           "--master_addr", os.environ["MASTER_ADDR"], "--master_port", os.environ["MASTER_PORT"],
           os.path.abspath(__file__), "train", "--config", config_path]
    # torchrun re-exports RANK/WORLD_SIZE per worker, so the pod-level values must not leak through
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    os.execv(sys.executable, cmd)


def tokenize_fn(tok, max_len):
    def fn(ex):
        prompt = tok.apply_chat_template(ex["messages"][:-1], tokenize=False, add_generation_prompt=True)
        answer = ex["messages"][-1]["content"] + tok.eos_token
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[:max_len]
        labels = ([-100] * len(p_ids) + a_ids)[:max_len]
        return {"input_ids": ids, "labels": labels}
    return fn


def collate(pad_id):
    def fn(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), n), -100, dtype=torch.long)
        att = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            L = len(b["input_ids"])
            ids[i, :L] = torch.tensor(b["input_ids"])
            lab[i, :L] = torch.tensor(b["labels"])
            att[i, :L] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return fn


def train(cfg):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=cfg["wandb_project"], id=os.environ.get("RUN_ID"), resume="allow",
               name=cfg["run_name"], config=cfg)

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    raw = load_dataset("json", data_files={"train": cfg["train_file"], "eval": cfg["eval_file"]})
    # map() results are cached on the shared volume; rank 0 fills the cache first
    if rank == 0:
        ds = raw.map(tokenize_fn(tok, cfg["max_len"]), remove_columns=raw["train"].column_names, num_proc=8)
    dist.barrier()
    if rank != 0:
        ds = raw.map(tokenize_fn(tok, cfg["max_len"]), remove_columns=raw["train"].column_names, num_proc=8)

    micro = cfg["micro_batch"]
    accum = cfg["global_batch"] // (micro * world)
    sampler = DistributedSampler(ds["train"], shuffle=True, seed=cfg["seed"])
    dl = DataLoader(ds["train"], batch_size=micro, sampler=sampler, collate_fn=collate(tok.pad_token_id),
                    num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(ds["eval"], batch_size=micro,
                         sampler=DistributedSampler(ds["eval"], shuffle=False, drop_last=True),
                         collate_fn=collate(tok.pad_token_id), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(cfg["model"], torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    total = cfg["epochs"] * (len(dl) // accum)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if (i + 1) % accum != 0:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        micro_loss = model(**batch).loss / accum
                    micro_loss.backward()
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / accum
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                wandb.log({"train/loss": loss.item() * accum, "train/grad_norm": gn.item(),
                           "train/lr": sched.get_last_lr()[0], "train/step_time": (time.time() - t0) / 10}, step=step)
                t0 = time.time()

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in eval_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                n = (batch["labels"][:, 1:] != -100).sum()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    acc[0] += model(**batch).loss.double() * n
                acc[1] += n
        dist.all_reduce(acc)
        eval_loss = (acc[0] / acc[1]).item()
        wandb.log({"eval/loss": eval_loss, "eval/ppl": math.exp(eval_loss), "epoch": epoch}, step=step)

        if rank == 0:
            out = os.path.join(cfg["output_dir"], f"epoch_{epoch}")
            model.module.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
            print(f"epoch {epoch} eval_loss {eval_loss:.4f} saved {out}", flush=True)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["entrypoint", "train"])
    ap.add_argument("--config", required=True)
    a = ap.parse_args()
    if a.mode == "entrypoint":
        entrypoint(a.config)
    else:
        with open(a.config) as f:
            train(json.load(f))


if __name__ == "__main__":
    main()
