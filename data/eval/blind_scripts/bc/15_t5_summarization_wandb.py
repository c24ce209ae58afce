"""Flan-T5 fine-tuning for incident-report summarization.

    sbatch --nodes=2 --gpus-per-node=8 --requeue jobs/t5_sum.sbatch
    # jobs/t5_sum.sbatch runs on each node:
    srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=2 \
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID \
        train_sum.py --config configs/flan_t5_large.yaml
"""
import argparse
import math
import os
import time

import evaluate as hf_evaluate
import torch
import torch.distributed as dist
import wandb
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq
from transformers.optimization import Adafactor


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-name", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["run_name"] = args.run_name or cfg.get("run_name", "t5-sum")
    return cfg


def init_tracking(cfg, world):
    job = os.environ.get("SLURM_JOB_ID", "local")
    return wandb.init(
        project=cfg["wandb_project"],
        entity=cfg.get("wandb_entity"),
        name=cfg["run_name"],
        id=f"{cfg['run_name']}-{job}",
        resume="allow",
        config={**cfg, "world_size": world},
        dir=cfg["out_dir"],
    )


def preprocess(examples, tokenizer, cfg):
    inputs = ["summarize: " + doc for doc in examples["report"]]
    model_inputs = tokenizer(inputs, max_length=cfg["max_source_len"], truncation=True)
    labels = tokenizer(text_target=examples["summary"], max_length=cfg["max_target_len"], truncation=True)
    model_inputs["labels"] = labels["input_ids"]
    return model_inputs


@torch.no_grad()
def generate_and_score(model, loader, tokenizer, device, rank, world, cfg):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             max_new_tokens=cfg["max_target_len"], num_beams=4)
        labels = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
        preds += tokenizer.batch_decode(out, skip_special_tokens=True)
        refs += tokenizer.batch_decode(labels, skip_special_tokens=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, (preds, refs))
    model.train()
    if rank != 0:
        return None
    all_p = [p for part in gathered for p in part[0]]
    all_r = [r for part in gathered for r in part[1]]
    rouge = hf_evaluate.load("rouge")
    return rouge.compute(predictions=all_p, references=all_r, use_stemmer=True)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(cfg["seed"])
    os.makedirs(cfg["out_dir"], exist_ok=True)

    run = init_tracking(cfg, world)

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    raw = load_dataset("json", data_files={"train": cfg["train_file"], "validation": cfg["val_file"]})
    map_kwargs = dict(batched=True, remove_columns=raw["train"].column_names,
                      fn_kwargs={"tokenizer": tokenizer, "cfg": cfg})
    # rank 0 tokenizes and fills the datasets cache, the others then read it
    if is_main:
        tokenized = raw.map(preprocess, **map_kwargs)
    dist.barrier()
    if not is_main:
        tokenized = raw.map(preprocess, **map_kwargs)

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(tokenized["train"], batch_size=cfg["batch_size"], sampler=sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    val = tokenized["validation"]
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=cfg["eval_batch_size"],
                            collate_fn=collator)

    model = AutoModelForSeq2SeqLM.from_pretrained(cfg["model"]).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    optimizer = Adafactor(ddp.parameters(), lr=cfg["lr"], relative_step=False, scale_parameter=False,
                          warmup_init=False)
    steps_per_epoch = len(train_loader) // cfg["grad_accum"]
    total = steps_per_epoch * cfg["epochs"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * max(0.0, 1 - s / total))

    ckpt_path = os.path.join(cfg["out_dir"], "last.pt")
    start_epoch, step, best = 0, 0, -1.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step, best = ckpt["epoch"] + 1, ckpt["step"], ckpt["best"]

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % cfg["grad_accum"] == 0
            if last_micro:
                loss = ddp(**batch).loss / cfg["grad_accum"]
                loss.backward()
            else:
                with ddp.no_sync():
                    loss = ddp(**batch).loss / cfg["grad_accum"]
                    loss.backward()
                continue
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % cfg["log_every"] == 0:
                l = loss.detach() * cfg["grad_accum"]
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if is_main:
                    run.log({"train/loss": l.item(), "lr": scheduler.get_last_lr()[0],
                             "epoch": epoch + i / len(train_loader)}, step=step)

        scores = generate_and_score(model, val_loader, tokenizer, device, rank, world, cfg)
        if is_main:
            run.log({f"val/{k}": v for k, v in scores.items()} | {"epoch_min": (time.time() - t0) / 60},
                    step=step)
            if scores["rougeL"] > best:
                best = scores["rougeL"]
                model.save_pretrained(os.path.join(cfg["out_dir"], "best"))
                tokenizer.save_pretrained(os.path.join(cfg["out_dir"], "best"))
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step, "best": best},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
