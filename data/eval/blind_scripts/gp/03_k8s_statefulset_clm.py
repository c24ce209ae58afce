"""Causal-LM fine-tuning on Kubernetes (StatefulSet + headless Service).

deploy/trainer.yaml runs N replicas of a StatefulSet "clm-trainer" behind the
headless Service "clm-trainer". Every pod gets 8 GPUs and mounts the shared
ReadWriteMany volume at /shared. The container command is

    python /app/train_clm.py launch --config /app/configs/clm.yaml

The c10d rendezvous store runs on pod 0 and is reached through its stable DNS
name; ranks are assigned by the rendezvous. torchrun restarts the workers on
failure, and the training code resumes from the last checkpoint on the shared
volume.
"""
import argparse
import json
import math
import os
import re
import socket
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import yaml
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup


def pod_ordinal():
    name = os.environ.get("POD_NAME", socket.gethostname())
    m = re.match(r"^(.*)-(\d+)$", name)
    if not m:
        raise RuntimeError(f"cannot parse StatefulSet ordinal from {name!r}")
    return m.group(1), int(m.group(2))


def launch(cfg_path):
    sts, ordinal = pod_ordinal()
    nnodes = int(os.environ["NNODES"])
    namespace = os.environ.get("POD_NAMESPACE", "default")
    service = os.environ.get("HEADLESS_SERVICE", sts)
    master = f"{sts}-0.{service}.{namespace}.svc.cluster.local"
    port = os.environ.get("RDZV_PORT", "29400")
    nproc = os.environ.get("GPUS_PER_POD", "8")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={master}:{port}",
        f"--rdzv_id={os.environ.get('JOB_ID', sts)}",
        "--max_restarts=3",
        os.path.abspath(__file__), "train", "--config", cfg_path,
    ]
    print(f"pod {sts}-{ordinal}/{nnodes}: {' '.join(cmd)}", flush=True)
    os.execv(sys.executable, cmd)


def is_main():
    return dist.get_rank() == 0


def save_checkpoint(path, model, optimizer, scheduler, step, epoch):
    if is_main():
        tmp = path + ".tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch}, tmp)
        os.replace(tmp, path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != -100).sum()
        acc[0] += out.loss.double() * n_tok
        acc[1] += n_tok
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def train(cfg_path):
    with open(cfg_path) as f:
        cfg = json.load(f) if cfg_path.endswith(".json") else yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], torch_dtype=torch.float32)
    if cfg.get("gradient_checkpointing", True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # produced once by prepare_data.py, already tokenized and packed
    ds = load_from_disk(cfg["dataset_path"])
    train_ds, val_ds = ds["train"], ds["validation"]
    train_ds.set_format("torch", columns=["input_ids", "attention_mask", "labels"])
    val_ds.set_format("torch", columns=["input_ids", "attention_mask", "labels"])

    micro = cfg["micro_batch_size"]
    accum = max(1, cfg["global_batch_size"] // (micro * world))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=micro, sampler=train_sampler, collate_fn=default_data_collator,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=micro, sampler=val_sampler, collate_fn=default_data_collator,
                        num_workers=2, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps_per_epoch = len(train_dl) // accum
    total_steps = steps_per_epoch * cfg["epochs"]
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg["warmup_ratio"] * total_steps), total_steps)

    out_dir = cfg["output_dir"]  # /shared/runs/<name>
    ckpt_path = os.path.join(out_dir, "last.pt")
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, start_epoch = ckpt["step"], ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}", flush=True)
    elif rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    if rank == 0:
        print(f"world={world} micro={micro} accum={accum} steps/epoch={steps_per_epoch}", flush=True)

    model.train()
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = 0.0
        for i, batch in enumerate(train_dl):
            if i >= steps_per_epoch * accum:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % accum == 0
            with (nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / accum
                loss.backward()
            running += loss.item()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % cfg["log_every"] == 0:
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {running / cfg['log_every']:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
                running = 0.0

        val_loss = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(min(val_loss, 20)):.2f}", flush=True)
        save_checkpoint(ckpt_path, model, optimizer, scheduler, step, epoch)

    if rank == 0:
        model.module.save_pretrained(os.path.join(out_dir, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(out_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("launch", "train"):
        sp = sub.add_parser(name)
        sp.add_argument("--config", required=True)
    args = p.parse_args()
    if args.cmd == "launch":
        launch(args.config)
    else:
        train(args.config)


if __name__ == "__main__":
    main()
